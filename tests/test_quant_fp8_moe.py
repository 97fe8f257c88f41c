"""fp8 mixture-of-experts checkpoints against transformers on the dequantised weights:
native fp8 (`quant_method: "fp8"`) with `weight_block_size` (the layout Qwen3-MoE-FP8
ships) or per tensor, and compressed-tensors FP8 per channel, in blocks and per tensor
(llm-compressor's FP8_DYNAMIC, FP8_BLOCK and FP8 recipes, `weight_scale`).

The checkpoints: tests/moe_checkpoints.py's tiny random Qwen3-MoE (hidden 64, 2 layers, 4
experts 32 wide, top 2) with every attention and expert projection quantised to
float8_e4m3fn by test_quant_fp8_checkpoints' reference quantiser (`weight` e4m3 and its
float32 scale per projection and expert: [ceil(out/16), ceil(in/16)] in 16x16 blocks,
[out, 1] per channel, or one value per tensor: [] natively, [1] in compressed-tensors);
the routers (`mlp.gate`) and the LM head stay float32, named in `modules_to_not_convert`
(as the Qwen3 FP8 checkpoints name them) or `ignore`. The oracle is transformers loading
the dequantised weights (q * scale, float32) under the original names. With float32
activations our CPU path computes exactly those products (the fp8 GEMV for a few rows,
dequantised tiles for more), so logits agree to float32 summation order, and so does
the routing.

At TP 2 each expert's intermediate width is sliced (in whole blocks, or per-channel
scales with their rows); under expert parallelism each rank holds whole experts. Either
way each rank holds its share of the checkpoint's expert bytes in fp8 with their
scales, not a float copy (a per-tensor scale held as one per output row). Also: the
engine's greedy tokens, sleep and wake, the dummy load format, a missing expert scale
and a per-tensor scale of several values (named), and the refusal of blocks that split
an expert's halves or a rank's slice at build. GPTQ, AWQ and compressed-tensors
int4/int8 experts: tests/test_quant_wna16_moe.py; W8A8 int8 experts, and how
compressed-tensors' targets and ignore place the experts: tests/test_quant_w8a8_moe.py.
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

from models.layers.quantization.fp8_moe import Fp8MoEMethod
from tests.conftest import run_tp
from tests.moe_checkpoints import decode_with_graphs, experts_layer, grouped_apply, write_moe_checkpoint
from tests.quant_checkpoints import assert_engine_greedy_matches, hf_logits
from tests.quant_tp_helpers import load_case, tp_quant_cases
from tests.test_quant_fp8_checkpoints import ct_fp8_config, dequantize_fp8_blocks, quantize_fp8_blocks

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


def ct_quantization_config(strategy: str) -> dict[str, Any]:
    """llm-compressor's FP8_DYNAMIC (`channel`) or FP8_BLOCK (`block`) recipe for a MoE model:
    every Linear but the routers and the LM head."""
    config = ct_fp8_config(strategy, True, list(BLOCK) if strategy == "block" else None)
    config["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    return config


# name -> (block (rows, cols), "channel" (one scale per output row) or "tensor" (one per
# projection: [] as native checkpoints store it, [1] as compressed-tensors does); the
# scale's name; its config)
FORMATS: dict[str, tuple[tuple[int, int] | str, str, Any]] = {
    "native_block": (BLOCK, "weight_scale_inv", quantization_config),
    "ct_channel": ("channel", "weight_scale", lambda layers: ct_quantization_config("channel")),
    "ct_block": (BLOCK, "weight_scale", lambda layers: ct_quantization_config("block")),
    "native_tensor": ("tensor", "weight_scale", lambda layers: quantization_config(layers, weight_block_size=None)),
    "ct_tensor": ("tensor", "weight_scale", lambda layers: ct_quantization_config("tensor")),
}


def scale_block(fmt: str, weight: torch.Tensor) -> tuple[int, int]:
    """The values one of `fmt`'s scales covers in `weight` [out, in]."""
    block = FORMATS[fmt][0]
    return block if isinstance(block, tuple) else (1, weight.shape[1]) if block == "channel" else tuple(weight.shape)


def write_fp8_moe(src: Path, out: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Write `src`'s checkpoint with its projections in fp8 (`fmt` of FORMATS) to `out`;
    return the tensors written."""
    from safetensors.torch import load_file, save_file

    _, scale_name, make_config = FORMATS[fmt]
    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _QUANTISED.search(name):
            q, scale = quantize_fp8_blocks(tensor.float(), *scale_block(fmt, tensor))
            if FORMATS[fmt][0] == "tensor":
                scale = scale.reshape(() if fmt.startswith("native") else (1,))
            tensors[name], tensors[name.removesuffix("weight") + scale_name] = q, scale
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = make_config(config["num_hidden_layers"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def write_dequantised(src: Path, tensors: dict[str, torch.Tensor], fmt: str, out: Path) -> None:
    """The oracle's checkpoint: `tensors`' fp8 weights as q * scale (float32), `src`'s config."""
    from safetensors.torch import save_file

    _, scale_name, _ = FORMATS[fmt]
    out.mkdir(parents=True)
    def grid(scale: torch.Tensor) -> torch.Tensor:  # a per-tensor scale, [] or [1]: a grid of one block
        return scale.reshape(1, 1) if scale.dim() < 2 else scale

    plain = {name: dequantize_fp8_blocks(t, grid(tensors[name.removesuffix("weight") + scale_name]),
                                         *scale_block(fmt, t))
             if t.dtype == FP8 else t for name, t in tensors.items() if not name.endswith(scale_name)}
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")


def write_case(root: Path, src: Path, fmt: str) -> SimpleNamespace:
    """The checkpoint in `fmt`, transformers on its dequantised weights and their logits."""
    from transformers import AutoModelForCausalLM

    tensors = write_fp8_moe(src, root / fmt, fmt)
    write_dequantised(src, tensors, fmt, root / f"{fmt}-reference")
    hf = AutoModelForCausalLM.from_pretrained(root / f"{fmt}-reference", dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = hf.config.eos_token_id = None
    expert_bytes = sum(t.numel() * t.element_size() for n, t in tensors.items() if _EXPERT_TENSOR.search(n))
    fp8_bytes = sum(t.numel() for n, t in tensors.items() if _EXPERT_TENSOR.search(n) and t.dtype == FP8)
    return SimpleNamespace(root=root, model=root / fmt, fmt=fmt, hf=hf, logits=hf_logits(hf, INPUT_IDS),
                           expert_bytes=expert_bytes, fp8_bytes=fp8_bytes, tensors=tensors)


@pytest.fixture(scope="module")
def fp8_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("fp8_moe")
    src = write_moe_checkpoint(root / "src", "qwen3_moe", seed=3)
    return {fmt: write_case(root, src, fmt) for fmt in FORMATS}


@pytest.fixture(scope="module")
def fp8_moe(fp8_cases: dict[str, SimpleNamespace]) -> SimpleNamespace:
    """The native block-fp8 checkpoint (Qwen3-MoE-FP8's layout)."""
    return fp8_cases["native_block"]


def variant(fp8_moe: SimpleNamespace, name: str, drop: str | None = None,
            replace: dict[str, torch.Tensor] | None = None, **config_fields: Any) -> Path:
    """A copy of the fp8 checkpoint without tensor `drop`, with tensors replaced, or with
    quantization_config fields replaced (None removes one)."""
    from safetensors.torch import save_file

    out = fp8_moe.root / name
    if out.exists():
        return out
    out.mkdir()
    tensors = {**{n: t for n, t in fp8_moe.tensors.items() if n != drop}, **(replace or {})}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_moe.model / "config.json").read_text())
    quant = config["quantization_config"]
    for key, value in config_fields.items():
        quant.pop(key) if value is None else quant.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def check_experts(result: dict[str, Any], fmt: str, shape: tuple[int, int, int], expected_bytes: int) -> None:
    """Every FusedMoE holds fp8 experts of `shape` [E_local, 2I, H] with their float32
    scales (`fmt`'s: blocks, or one per output channel, which per-tensor scales are held
    as), and nothing else: `expected_bytes` in all."""
    block, scale_name, _ = FORMATS[fmt]
    assert len(result["experts"]) == 2
    num_local, rows, hidden = shape
    if isinstance(block, tuple):
        bn, bk = block
        scales = {"w13": (num_local, rows // bn, hidden // bk), "w2": (num_local, hidden // bn, rows // 2 // bk)}
    else:
        scales = {"w13": (num_local, rows, 1), "w2": (num_local, hidden, 1)}
    for tensors in result["experts"].values():
        assert tensors == {
            "w13_weight": (str(FP8), shape),
            "w2_weight": (str(FP8), (num_local, hidden, rows // 2)),
            f"w13_{scale_name}": ("torch.float32", scales["w13"]),
            f"w2_{scale_name}": ("torch.float32", scales["w2"]),
        }
    assert result["expert_bytes"] == expected_bytes


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_moe_logits_match_transformers(fp8_cases: dict[str, SimpleNamespace], fmt: str) -> None:
    case = fp8_cases[fmt]
    result = load_case({"model": str(case.model), "input_ids": INPUT_IDS})
    torch.testing.assert_close(result["logits"], case.logits, atol=LOGITS_ATOL, rtol=0)
    check_experts(result, fmt, (4, 64, 64), held_bytes(case, fmt, (4, 64, 64), 1))
    methods = result["methods"]
    dense = "Fp8CheckpointLinearMethod" if fmt.startswith("native") else "CompressedTensorsLinearMethod"
    assert methods["model.layers.0.self_attn.qkv_proj"] == dense
    assert methods["model.layers.1.self_attn.o_proj"] == dense
    assert result["dtypes"]["model.layers.0.self_attn.qkv_proj"] == str(FP8)
    assert result["dtypes"]["model.layers.0.mlp.gate"] == "torch.float32"  # left unquantised by name


def held_bytes(case: SimpleNamespace, fmt: str, shape: tuple[int, int, int], ranks: int) -> int:
    """The expert bytes a rank holding `shape` [E_local, 2I, H] has: its share of the
    checkpoint's (fp8 weights and scales); for per-tensor formats its share of the fp8
    weights and each projection's one scale as one per output row (float32, 2 layers)."""
    if FORMATS[fmt][0] != "tensor":
        return case.expert_bytes // ranks
    num_local, rows, hidden = shape
    return case.fp8_bytes // ranks + 2 * num_local * (rows + hidden) * 4


def test_fp8_moe_tensor_and_expert_parallel_logits_match_transformers(fp8_cases: dict[str, SimpleNamespace]) -> None:
    """TP 2: every expert on both ranks, its intermediate width sliced (in whole blocks, or
    per-channel scales with their rows; w2's per-channel scale whole on each rank); TP 2
    with expert parallelism: two whole experts per rank. Each rank holds half the
    checkpoint's expert bytes, in fp8 (w2's per-channel scales on both ranks)."""
    runs = [("native_block", False), ("native_block", True), ("ct_channel", False), ("ct_block", True),
            ("native_tensor", False), ("ct_tensor", True)]
    cases = [{"name": f"{fmt}-{'ep' if ep else 'tp'}", "model": str(fp8_cases[fmt].model), "input_ids": INPUT_IDS,
              "kwargs": {"enable_expert_parallel": ep}} for fmt, ep in runs]
    expert_map_bytes = 2 * 4 * 8  # under EP each layer also holds its map of the 4 experts (int64)
    # w2's per-channel scales (2 layers x 4 experts x 64 rows of float32) are whole on each rank: half of
    # them beyond half the checkpoint's bytes
    w2_channel_scale_bytes = 2 * 4 * 64 * 4
    for rank_result in run_tp(tp_quant_cases, 2, cases):
        for fmt, ep in runs:
            result, case = rank_result[f"{fmt}-{'ep' if ep else 'tp'}"], fp8_cases[fmt]
            torch.testing.assert_close(result["logits"], case.logits, atol=LOGITS_ATOL, rtol=0)
            shape = (2, 64, 64) if ep else (4, 32, 64)
            extra = expert_map_bytes if ep else w2_channel_scale_bytes // 2 if fmt == "ct_channel" else 0
            check_experts(result, fmt, shape, held_bytes(case, fmt, shape, 2) + extra)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_moe_engine_greedy_matches_transformers(fp8_moe: SimpleNamespace, tp: int) -> None:
    """Through the engine (decode steps' experts in one C call, replayed as CPU graphs)."""
    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    assert_engine_greedy_matches(fp8_moe.model, fp8_moe.hf, prompts, 8, tensor_parallel_size=tp)


@pytest.mark.slow
def test_sleep_and_wake_keep_fp8_experts(fp8_moe: SimpleNamespace) -> None:
    """The experts' fp8 tensors and scales are registered parameters: the worker counts
    them, level 2 releases them with the other weights and waking reloads them, and the
    greedy tokens stay the same."""
    from config import SamplingParams
    from tests.test_quant_sleep import assert_sleep_and_wake_keep

    def fp8_bytes(worker: Any) -> int:
        model = worker.model_runner.model
        return sum(t.numel() * t.element_size() for t in model.parameters() if t.dtype == FP8)

    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    assert_sleep_and_wake_keep(fp8_moe.model, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               fp8_bytes)


def test_dummy_load_format_fills_fp8_experts(fp8_moe: SimpleNamespace) -> None:
    result = load_case({"model": str(fp8_moe.model), "input_ids": INPUT_IDS, "kwargs": {"load_format": "dummy"}})
    assert result["logits"].isfinite().all()
    check_experts(result, "native_block", (4, 64, 64), fp8_moe.expert_bytes)


def test_fp8_moe_missing_expert_scale_is_named(fp8_moe: SimpleNamespace) -> None:
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    model = variant(fp8_moe, "missing_scale", drop=name)
    kind, message = load_case({"model": str(model), "input_ids": INPUT_IDS, "expect_error": True})["error"]
    assert kind == "WeightLoadError" and name in message, message


def test_per_tensor_expert_scale_of_several_values_is_named(fp8_cases: dict[str, SimpleNamespace]) -> None:
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    model = variant(fp8_cases["native_tensor"], "two_value_scale", replace={name: torch.ones(2)})
    kind, message = load_case({"model": str(model), "input_ids": INPUT_IDS, "expect_error": True})["error"]
    assert kind == "WeightLoadError" and name in message and "one value" in message, message


@pytest.mark.parametrize("intermediate, tp, sliced", [(24, 1, False), (32, 4, True)], ids=["tp1", "tp4"])
def test_blocks_that_split_an_experts_halves_or_slice_are_refused(intermediate: int, tp: int, sliced: bool) -> None:
    """The gate and up halves of w13 meet on a block boundary, and a TP rank's slice of an
    expert is whole blocks (24 experts wide at TP 1, 32 at TP 4: 8 a rank)."""
    layer = torch.nn.Module()
    layer.weight_loader, layer.slice_intermediate, layer.tp_size = None, sliced, tp
    layer.intermediate_size = intermediate
    with pytest.raises(ValueError) as raised:
        Fp8MoEMethod("block", BLOCK, "weight_scale_inv").create_weights(layer, 4, 64, intermediate // tp, torch.float32)
    needles = ["weight_block_size=[16, 16]", f"moe_intermediate_size={intermediate}"]
    needles += [f"tensor_parallel_size={tp}", "expert parallelism"] if sliced else ["gate and up halves"]
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


@pytest.mark.parametrize("fmt", ["native_block", "ct_channel"])
def test_one_call_experts_compute_the_grouped_experts(fp8_cases: dict[str, SimpleNamespace], fmt: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's experts in one C call (fp8_moe.c, each product the fp8 GEMV, more
    than 16 tokens of an expert in chunks) against the experts grouped in torch, for 1, 7
    and 64 float32 and bfloat16 tokens; an expert id past the model's is named."""
    from models.layers.fused_moe.router import fused_topk
    from models.layers.quantization import fp8_moe

    for dtype, tol in (("float32", 2e-5), ("bfloat16", 2e-2)):
        layer = experts_layer(fp8_cases[fmt].model, dtype)
        for tokens in (1, 7, 64):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, 64, generator=gen).to(getattr(torch, dtype))
            weights, ids = fused_topk(torch.randn(tokens, 4, generator=gen), 2, True)
            one_call = layer.quant_method.apply(layer, x, weights, ids)
            grouped = grouped_apply(fp8_moe, layer, x, weights, ids, monkeypatch)
            assert one_call.dtype == x.dtype
            torch.testing.assert_close(one_call.float(), grouped.float(), atol=tol, rtol=tol)
    ids[0, 1] = 4
    with pytest.raises(ValueError, match="outside the model's 4 experts"):
        layer.quant_method.apply(layer, x, weights, ids)


@pytest.mark.parametrize("strategy, block", [("block", (32, 32)), ("channel", None)])
def test_one_call_bf16_experts_match_float64(strategy: str, block: tuple[int, int] | None) -> None:
    """bfloat16 tokens on an AVX-512 BF16 CPU take fp8_moe.c's bfloat16 path (every
    active expert's rows shared over the threads, bfloat16 dot products of the exact fp8
    values, each k-block's sums times its scale, silu(gate) * up rounded to bfloat16
    between the products); elsewhere the float32 GEMV's. Either against float64 on the
    dequantised weights with that one rounding of the activation, to two bfloat16
    roundings of each output, for 1, 5 and 64 tokens."""
    from models.layers.fused_moe.router import fused_topk
    from tests.test_quant_fp8_checkpoints import dequantize_fp8_blocks, quantize_fp8_blocks

    experts, hidden, inter = 4, 128, 64
    gen = torch.Generator().manual_seed(3)
    bn, bk = block or (1, 10**6)
    layer = torch.nn.Module()
    layer.weight_loader, layer.expert_map, layer.num_experts = None, None, experts
    method = Fp8MoEMethod(strategy, block, "weight_scale")
    method.create_weights(layer, experts, hidden, inter, torch.bfloat16)
    deq13, deq2 = [], []
    for e in range(experts):
        q13, s13 = quantize_fp8_blocks(torch.randn(2 * inter, hidden, generator=gen), bn, min(bk, hidden))
        q2, s2 = quantize_fp8_blocks(torch.randn(hidden, inter, generator=gen), bn, min(bk, inter))
        layer.w13_weight.data[e], layer.w13_weight_scale.data[e] = q13, s13
        layer.w2_weight.data[e], layer.w2_weight_scale.data[e] = q2, s2
        deq13.append(dequantize_fp8_blocks(q13, s13, bn, min(bk, hidden)).double())
        deq2.append(dequantize_fp8_blocks(q2, s2, bn, min(bk, inter)).double())
    method.process_weights_after_loading(layer)
    for tokens in (1, 5, 64):
        x = torch.randn(tokens, hidden, generator=gen).bfloat16()
        weights, ids = fused_topk(torch.randn(tokens, experts, generator=gen), 2, True)
        got = method.apply(layer, x, weights, ids)
        ref = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j in range(2):
                e = int(ids[t, j])
                gate, up = (x[t].double() @ deq13[e].t()).split(inter)
                act = (gate * torch.sigmoid(gate) * up).to(torch.bfloat16).double()
                ref[t] += float(weights[t, j]) * (act @ deq2[e].t())
        assert got.dtype == torch.bfloat16
        # each output within two bfloat16 roundings of its value (observed: 0.38%)
        torch.testing.assert_close(got.double(), ref, atol=1e-3 * ref.abs().max().item(), rtol=2.0 ** -7)


def test_fp8_moe_decode_steps_are_recorded_and_replay_eager(fp8_moe: SimpleNamespace) -> None:
    """The one-call experts read the routing from tensors: every decode batch size is
    recorded as a CPU graph and replays the eager steps' tokens and logprobs."""
    eager, none = decode_with_graphs(fp8_moe.model, True)
    replayed, sizes = decode_with_graphs(fp8_moe.model, False)
    assert none == [[]] and sizes == [[1, 2, 3]]
    assert replayed == eager


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_moe_on_cuda_matches_the_cpu(fp8_moe: SimpleNamespace) -> None:
    """The same experts on CUDA (each product the Triton GEMM over the fp8 bytes) against
    the CPU's, to bf16 rounding."""
    from models.layers.fused_moe.router import fused_topk

    layer = torch.nn.Module()
    layer.weight_loader, layer.expert_map = None, None
    Fp8MoEMethod("block", BLOCK, "weight_scale_inv").create_weights(layer, 4, 64, 32, torch.bfloat16)
    prefix = "model.layers.0.mlp.experts"
    for e in range(4):
        for suffix in ("weight", "weight_scale_inv"):
            w13, w2 = getattr(layer, f"w13_{suffix}"), getattr(layer, f"w2_{suffix}")
            gate, up = (fp8_moe.tensors[f"{prefix}.{e}.{p}_proj.{suffix}"] for p in ("gate", "up"))
            w13.data[e] = torch.cat([gate, up])
            w2.data[e] = fp8_moe.tensors[f"{prefix}.{e}.down_proj.{suffix}"]
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    weights, ids = fused_topk(torch.randn(40, 4, generator=torch.Generator().manual_seed(2)), 2, True)
    method = Fp8MoEMethod("block", BLOCK, "weight_scale_inv")
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
