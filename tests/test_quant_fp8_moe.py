"""Block-scaled fp8 mixture-of-experts checkpoints (`quant_method: "fp8"` with
`weight_block_size`, the layout Qwen3-MoE-FP8 ships) against transformers on the
dequantised weights.

The checkpoint: tests/moe_checkpoints.py's tiny random Qwen3-MoE (hidden 64, 2 layers, 4
experts 32 wide, top 2) with every attention and expert projection quantised to
float8_e4m3fn in 16x16 blocks by test_quant_fp8_checkpoints' reference quantiser
(`weight` e4m3, `weight_scale_inv` [ceil(out/16), ceil(in/16)] float32 per projection and
expert); the routers (`mlp.gate`) and the LM head stay float32, listed in
`modules_to_not_convert` as the Qwen3 FP8 checkpoints list them. The oracle is
transformers loading the dequantised weights (q * scale, float32) under the original
names. With float32 activations our CPU path computes exactly those products (the fp8
GEMV for a few rows, dequantised tiles for more), so logits agree to float32 summation
order, and so does the routing.

At TP 2 each expert's intermediate width is sliced in whole blocks; under expert
parallelism each rank holds whole experts. Either way each rank holds its share of the
checkpoint's expert bytes in fp8 with their block scales, not a float copy. Also: the
engine's greedy tokens, sleep and wake, the dummy load format, a missing expert scale
(named), and the refusals: experts in another quantised layout at resolution, blocks
that split an expert's halves or a rank's slice at build.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from config import ConfigError
from engine.arg_utils import create_engine_config
from models.layers.quantization.fp8_moe import Fp8MoEMethod
from tests.conftest import run_tp
from tests.moe_checkpoints import write_moe_checkpoint
from tests.quant_checkpoints import assert_engine_greedy_matches, hf_logits
from tests.quant_tp_helpers import load_case, tp_quant_cases
from tests.test_quant_fp8_checkpoints import dequantize_fp8_blocks, quantize_fp8_blocks

FP8 = torch.float8_e4m3fn
BLOCK = (16, 16)
LOGITS_ATOL = 1e-4
INPUT_IDS = torch.randint(3, 320, (12,), generator=torch.Generator().manual_seed(7))
_QUANTISED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")


def quantization_config(num_layers: int, **fields: Any) -> dict[str, Any]:
    """A native fp8 quantization_config as Qwen3-MoE-FP8's config.json writes it."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK),
            "modules_to_not_convert": ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(num_layers))],
            **fields}


def write_fp8_moe(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """Write `src`'s checkpoint with its projections in fp8 blocks to `out`; return the
    tensors written."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _QUANTISED.search(name):
            q, scale = quantize_fp8_blocks(tensor.float(), *BLOCK)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(config["num_hidden_layers"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def write_dequantised(src: Path, tensors: dict[str, torch.Tensor], out: Path) -> None:
    """The oracle's checkpoint: `tensors`' fp8 weights as q * scale (float32), `src`'s config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    plain = {name: dequantize_fp8_blocks(t, tensors[name.removesuffix("weight") + "weight_scale_inv"], *BLOCK)
             if t.dtype == FP8 else t for name, t in tensors.items() if not name.endswith("weight_scale_inv")}
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8_moe")
    src = write_moe_checkpoint(root / "src", "qwen3_moe", seed=3)
    tensors = write_fp8_moe(src, root / "fp8")
    write_dequantised(src, tensors, root / "reference")
    hf = AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = hf.config.eos_token_id = None
    expert_bytes = sum(t.numel() * t.element_size() for n, t in tensors.items() if _EXPERT_TENSOR.search(n))
    return SimpleNamespace(root=root, model=root / "fp8", hf=hf, logits=hf_logits(hf, INPUT_IDS),
                           expert_bytes=expert_bytes, tensors=tensors)


def variant(fp8_moe: SimpleNamespace, name: str, drop: str | None = None, **config_fields: Any) -> Path:
    """A copy of the fp8 checkpoint without tensor `drop`, or with quantization_config
    fields replaced (None removes one)."""
    from safetensors.torch import save_file

    out = fp8_moe.root / name
    if out.exists():
        return out
    out.mkdir()
    save_file({n: t for n, t in fp8_moe.tensors.items() if n != drop}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((fp8_moe.model / "config.json").read_text())
    quant = config["quantization_config"]
    for key, value in config_fields.items():
        quant.pop(key) if value is None else quant.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def check_experts(result: dict[str, Any], shape: tuple[int, int, int], expected_bytes: int) -> None:
    """Every FusedMoE holds fp8 experts of `shape` [E_local, 2I, H] with their float32 block
    scales, and nothing else: `expected_bytes` in all."""
    assert len(result["experts"]) == 2
    num_local, rows, hidden = shape
    for tensors in result["experts"].values():
        assert tensors == {
            "w13_weight": (str(FP8), shape),
            "w2_weight": (str(FP8), (num_local, hidden, rows // 2)),
            "w13_weight_scale_inv": ("torch.float32", (num_local, rows // BLOCK[0], hidden // BLOCK[1])),
            "w2_weight_scale_inv": ("torch.float32", (num_local, hidden // BLOCK[0], rows // 2 // BLOCK[1])),
        }
    assert result["expert_bytes"] == expected_bytes


def test_fp8_moe_logits_match_transformers(fp8_moe: SimpleNamespace) -> None:
    result = load_case({"model": str(fp8_moe.model), "input_ids": INPUT_IDS})
    torch.testing.assert_close(result["logits"], fp8_moe.logits, atol=LOGITS_ATOL, rtol=0)
    check_experts(result, (4, 64, 64), fp8_moe.expert_bytes)
    methods = result["methods"]
    assert methods["model.layers.0.self_attn.qkv_proj"] == "Fp8CheckpointLinearMethod"
    assert methods["model.layers.1.self_attn.o_proj"] == "Fp8CheckpointLinearMethod"
    assert result["dtypes"]["model.layers.0.mlp.gate"] == "torch.float32"  # modules_to_not_convert


def test_fp8_moe_tensor_and_expert_parallel_logits_match_transformers(fp8_moe: SimpleNamespace) -> None:
    """TP 2: every expert on both ranks, its intermediate width sliced in whole blocks; TP 2
    with expert parallelism: two whole experts per rank. Each rank holds half the
    checkpoint's expert bytes, in fp8."""
    cases = [{"name": "tp", "model": str(fp8_moe.model), "input_ids": INPUT_IDS},
             {"name": "ep", "model": str(fp8_moe.model), "input_ids": INPUT_IDS,
              "kwargs": {"enable_expert_parallel": True}}]
    expert_map_bytes = 2 * 4 * 8  # under EP each layer also holds its map of the 4 experts (int64)
    for rank_result in run_tp(tp_quant_cases, 2, cases):
        for name, shape, extra in (("tp", (4, 32, 64), 0), ("ep", (2, 64, 64), expert_map_bytes)):
            torch.testing.assert_close(rank_result[name]["logits"], fp8_moe.logits, atol=LOGITS_ATOL, rtol=0)
            check_experts(rank_result[name], shape, fp8_moe.expert_bytes // 2 + extra)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_moe_engine_greedy_matches_transformers(fp8_moe: SimpleNamespace, tp: int) -> None:
    """Through the engine (its steps eager: grouping the experts reads counts on the host)."""
    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    assert_engine_greedy_matches(fp8_moe.model, fp8_moe.hf, prompts, 8, tensor_parallel_size=tp)


@pytest.mark.slow
def test_sleep_and_wake_keep_fp8_experts(fp8_moe: SimpleNamespace) -> None:
    """The experts' fp8 tensors and scales are registered parameters: the worker counts
    them, level 2 releases them with the other weights and waking reloads them, and the
    greedy tokens stay the same."""
    from config import SamplingParams
    from engine.core import EngineCore

    def fp8_bytes(worker: Any) -> int:
        model = worker.model_runner.model
        return sum(t.numel() * t.element_size() for t in model.parameters() if t.dtype == FP8)

    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with EngineCore(model=str(fp8_moe.model), device="cpu", dtype="float32", max_model_len=64,
                    kv_cache_memory_bytes=4 << 20, use_tqdm_on_load=False, enable_sleep_mode=True) as core:
        reference = [o.token_ids for o in core.generate(prompts, params)]
        (weights,) = core.collective_rpc(lambda worker: worker.model_memory_usage)
        (fp8,) = core.collective_rpc(fp8_bytes)
        assert 0 < fp8 < weights
        for level in (1, 2):
            (report,) = core.sleep(level)
            if level == 2:
                assert report["bytes"]["weights"] == weights
            core.wake_up()
            assert [o.token_ids for o in core.generate(prompts, params)] == reference, f"level {level}"
            assert core.collective_rpc(fp8_bytes) == [fp8]


def test_dummy_load_format_fills_fp8_experts(fp8_moe: SimpleNamespace) -> None:
    result = load_case({"model": str(fp8_moe.model), "input_ids": INPUT_IDS, "kwargs": {"load_format": "dummy"}})
    assert result["logits"].isfinite().all()
    check_experts(result, (4, 64, 64), fp8_moe.expert_bytes)


def test_fp8_moe_missing_expert_scale_is_named(fp8_moe: SimpleNamespace) -> None:
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    model = variant(fp8_moe, "missing_scale", drop=name)
    kind, message = load_case({"model": str(model), "input_ids": INPUT_IDS, "expect_error": True})["error"]
    assert kind == "WeightLoadError" and name in message, message


@pytest.mark.parametrize("fields, needles", [
    ({"weight_block_size": None}, ("quant_method='fp8'", "weight_block_size")),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, ("quant_method='gptq'", "mixture-of-experts")),
], ids=["fp8-per-tensor", "gptq"])
def test_quantised_experts_in_other_layouts_are_refused_at_resolution(fp8_moe: SimpleNamespace, fields: dict,
                                                                      needles: tuple[str, ...]) -> None:
    model = variant(fp8_moe, "refused_" + "_".join(fields), **fields)
    with pytest.raises(ConfigError) as raised:
        create_engine_config(model=str(model), device="cpu")
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


@pytest.mark.parametrize("intermediate, tp, sliced", [(24, 1, False), (32, 4, True)], ids=["tp1", "tp4"])
def test_blocks_that_split_an_experts_halves_or_slice_are_refused(intermediate: int, tp: int, sliced: bool) -> None:
    """The gate and up halves of w13 meet on a block boundary, and a TP rank's slice of an
    expert is whole blocks (24 experts wide at TP 1, 32 at TP 4: 8 a rank)."""
    layer = torch.nn.Module()
    layer.weight_loader, layer.slice_intermediate, layer.tp_size = None, sliced, tp
    layer.intermediate_size = intermediate
    with pytest.raises(ValueError) as raised:
        Fp8MoEMethod(BLOCK).create_weights(layer, 4, 64, intermediate // tp, torch.float32)
    needles = ["weight_block_size=[16, 16]", f"moe_intermediate_size={intermediate}"]
    needles += [f"tensor_parallel_size={tp}", "expert parallelism"] if sliced else ["gate and up halves"]
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_moe_on_cuda_matches_the_cpu(fp8_moe: SimpleNamespace) -> None:
    """The same experts on CUDA (each product the Triton GEMM over the fp8 bytes) against
    the CPU's, to bf16 rounding."""
    from models.layers.fused_moe.router import fused_topk

    layer = torch.nn.Module()
    layer.weight_loader, layer.expert_map = None, None
    Fp8MoEMethod(BLOCK).create_weights(layer, 4, 64, 32, torch.bfloat16)
    prefix = "model.layers.0.mlp.experts"
    for e in range(4):
        for suffix in ("weight", "weight_scale_inv"):
            w13, w2 = getattr(layer, f"w13_{suffix}"), getattr(layer, f"w2_{suffix}")
            gate, up = (fp8_moe.tensors[f"{prefix}.{e}.{p}_proj.{suffix}"] for p in ("gate", "up"))
            w13.data[e] = torch.cat([gate, up])
            w2.data[e] = fp8_moe.tensors[f"{prefix}.{e}.down_proj.{suffix}"]
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    weights, ids = fused_topk(torch.randn(40, 4, generator=torch.Generator().manual_seed(2)), 2, True)
    method = Fp8MoEMethod(BLOCK)
    cpu = method.apply(layer, x, weights, ids)
    layer.cuda()
    gpu = method.apply(layer, x.cuda(), weights.cuda(), ids.cuda()).cpu()
    torch.testing.assert_close(gpu.float(), cpu.float(), atol=4 * 2.0 ** -8 * cpu.abs().max().item(), rtol=0)


def test_cuda_graphs_are_not_captured_through_fp8_experts(fp8_moe: SimpleNamespace,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The grouping reads the per-expert counts on the host, which a CUDA graph capture
    cannot: the graph runner captures nothing for such a model, names the layer, and its
    decode steps run eagerly from the same buffers (here on the CPU, where it stops
    before any CUDA call)."""
    from config import SamplingParams
    from engine.core import EngineCore
    from worker.cuda_graph import CudaGraphRunner

    with EngineCore(model=str(fp8_moe.model), device="cpu", dtype="float32", attention_backend="TRITON_ATTN",
                    max_model_len=64, kv_cache_memory_bytes=4 << 20, block_size=16,
                    use_tqdm_on_load=False) as core:
        prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        eager = [o.token_ids for o in core.generate(prompts, params)]
        runner = core.model_executor.worker.model_runner
        graphs = CudaGraphRunner(runner.model, runner.attn_backend, [1, 2, 4], max_blocks=4, block_size=16,
                                 device=torch.device("cpu"))
        with caplog.at_level("WARNING", logger="worker.cuda_graph"):
            assert graphs.capture() == 0.0
        assert not graphs.captured
        assert "model.layers.0.mlp.experts (Fp8MoEMethod)" in caplog.text
        runner.cuda_graphs = graphs
        assert [o.token_ids for o in core.generate(prompts, params)] == eager
