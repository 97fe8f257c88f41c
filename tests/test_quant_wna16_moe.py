"""int4/int8 weight-only mixture-of-experts checkpoints (GPTQ, AWQ, compressed-tensors
W4A16/W8A16) against transformers on the dequantised weights.

The checkpoints: tests/moe_checkpoints.py's tiny random Qwen3-MoE (hidden 64, 2 layers, 4
experts, top 2; experts 64 wide here, so that a TP 2 rank's half holds whole groups of
32) and one Mixtral of the same size, every attention and expert projection quantised by
tests/wna16_formats.py's reference quantisers (AutoGPTQ's, AutoAWQ's and
compressed-tensors' documented layouts). The routers (`mlp.gate`) and the LM head stay
float32; the GPTQ and AWQ configs do not name the routers (as GPTQModel's and AutoAWQ's
Qwen3-MoE checkpoints do not), so the router must be built unquantised, as vLLM builds
it. The oracle is transformers loading the dequantised weights; with float32
activations our CPU path computes the same products (the GEMV for a few rows, tiles for
more), so logits agree to float32 summation order, and so does the routing.

At TP 2 each expert's intermediate width is sliced (whole groups and packs per rank;
per-channel scales of w2 whole on each rank); under expert parallelism each rank holds
whole experts. Either way each rank holds the codes at the checkpoint's bits (its share
of them), compact scales and byte zero points, and nothing else: no float copy. Also:
the engine's greedy tokens, sleep and wake, the dummy load format, a missing expert
tensor (named), act-order refused at resolution, groups that split a rank's slice, and
a decode step's experts in one C call: against the grouped path, and recorded as a CPU
graph that replays the eager steps.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from config import ConfigError
from engine.arg_utils import create_engine_config
from models.layers.quantization.wna16_moe import WNA16ExpertFormat, WNA16MoEMethod
from tests.conftest import run_tp
from tests.moe_checkpoints import decode_with_graphs, experts_layer, grouped_apply, write_moe_checkpoint
from tests.quant_checkpoints import assert_engine_greedy_matches, hf_logits
from tests.quant_tp_helpers import load_case, tp_quant_cases
from tests.wna16_formats import awq_quantizer, ct_quantization_config, ct_quantizer, gptq_quantizer

LOGITS_ATOL = 1e-4
INPUT_IDS = torch.randint(3, 320, (12,), generator=torch.Generator().manual_seed(7))
HIDDEN, INTER, EXPERTS = 64, 64, 4
_QUANTISED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")


def _gptq(bits: int, group: int, sym: bool, desc_act: bool = False, fmt: str = "gptq") -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": fmt, "lm_head": False}


def _awq(group: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


def _ct(bits: int, group: int, sym: bool, actorder: str | None = None) -> dict[str, Any]:
    return ct_quantization_config(bits, group, sym, actorder, ignore=["re:.*mlp.gate$"])


# name -> (family, quantiser, quantization_config, bits, group (-1 per channel), scale dtype as held: the
# narrowest that holds every scale exactly; compressed-tensors' bfloat16 scales of these weights
# (about 1e-3 to 1e-2) are float16 values too)
FORMATS: dict[str, tuple[str, Callable, dict[str, Any], int, int, torch.dtype]] = {
    "gptq4_g32_sym": ("qwen3_moe", gptq_quantizer(4, 32, True, False), _gptq(4, 32, True), 4, 32, torch.float16),
    "gptq8_channel_asym_v2": ("qwen3_moe", gptq_quantizer(8, -1, False, False, "gptq_v2"),
                              _gptq(8, -1, False, fmt="gptq_v2"), 8, -1, torch.float16),
    "awq_g32": ("qwen3_moe", awq_quantizer(32), _awq(32), 4, 32, torch.float16),
    "ct4_g32_asym": ("qwen3_moe", ct_quantizer(4, 32, False), _ct(4, 32, False), 4, 32, torch.float16),
    "ct8_channel_sym": ("qwen3_moe", ct_quantizer(8, -1, True), _ct(8, -1, True), 8, -1, torch.float16),
    "mixtral_gptq4_g32": ("mixtral", gptq_quantizer(4, 32, False, False), _gptq(4, 32, False), 4, 32,
                          torch.float16),
}


def write_wna16_moe(src: Path, out: Path, quantize: Callable, quantization_config: dict[str, Any]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Write `src`'s checkpoint with its projections quantised to `out`; return (the
    tensors written, the dequantised state dict)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    dequantised: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if _QUANTISED.search(name):
            module = name.removesuffix(".weight")
            parts, dequantised[name] = quantize(module, tensor.float())
            tensors.update({f"{module}.{suffix}": t.contiguous() for suffix, t in parts.items()})
        else:
            tensors[name] = dequantised[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return tensors, dequantised


def write_case(root: Path, sources: dict[str, Path], name: str) -> SimpleNamespace:
    """The checkpoint in format `name`, transformers on its dequantised weights and their logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    family, quantize, qcfg, bits, group, scale_dtype = FORMATS[name]
    tensors, dequantised = write_wna16_moe(sources[family], root / name, quantize, qcfg)
    reference = root / f"{name}-reference"
    reference.mkdir()
    save_file(dequantised, str(reference / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(sources[family] / "config.json", reference / "config.json")
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = hf.config.eos_token_id = None
    codes = ("qweight", "weight_packed")
    code_bytes = sum(t.numel() * t.element_size() for n, t in tensors.items()
                     if _EXPERT_TENSOR.search(n) and n.rsplit(".", 1)[1] in codes)
    return SimpleNamespace(root=root, model=root / name, name=name, hf=hf, logits=hf_logits(hf, INPUT_IDS),
                           tensors=tensors, bits=bits, group=group, scale_dtype=scale_dtype, code_bytes=code_bytes)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("wna16_moe")
    sources = {"qwen3_moe": write_moe_checkpoint(root / "qwen3", "qwen3_moe", seed=5, moe_intermediate_size=INTER),
               "mixtral": write_moe_checkpoint(root / "mixtral", "mixtral", seed=6, intermediate_size=INTER)}
    return {name: write_case(root, sources, name) for name in FORMATS}


def expected_experts(case: SimpleNamespace, num_local: int, inter: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a FusedMoE holding `num_local` experts `inter` wide holds in the WNA16 layout."""
    held: dict[str, tuple[str, tuple[int, ...]]] = {}
    for prefix, rows, cols in (("w13", 2 * inter, HIDDEN), ("w2", HIDDEN, inter)):
        groups = 1 if case.group == -1 else cols // case.group
        held[f"{prefix}_wna16_qweight"] = ("torch.uint8", (num_local, rows, cols * case.bits // 8))
        held[f"{prefix}_wna16_scales"] = (str(case.scale_dtype), (num_local, rows, groups))
        held[f"{prefix}_wna16_zeros"] = ("torch.uint8", (num_local, rows, groups))
        held[f"{prefix}_wna16_block_group"] = ("torch.int32", (-(-cols // 32),))
    return held


def check_experts(result: dict[str, Any], case: SimpleNamespace, num_local: int, inter: int, ranks: int,
                  ep: bool = False) -> int:
    """Every FusedMoE holds its experts in the WNA16 layout and nothing else (the
    checkpoint's tensors gone, no float weight), its codes exactly this rank's share of
    the checkpoint's packed codes. Returns the bytes of those codes."""
    expected = expected_experts(case, num_local, inter)
    assert len(result["experts"]) == 2
    for held in result["experts"].values():
        assert held == expected
    sizes = {name: torch.Size(shape).numel() * getattr(torch, dtype.removeprefix("torch.")).itemsize
             for name, (dtype, shape) in expected.items()}
    expert_map = 2 * EXPERTS * 8 if ep else 0  # under EP each layer also holds its map of the experts (int64)
    assert result["expert_bytes"] == 2 * sum(sizes.values()) + expert_map
    code_bytes = 2 * sum(size for name, size in sizes.items() if "qweight" in name)
    assert code_bytes == case.code_bytes // ranks
    return code_bytes


@pytest.mark.parametrize("name", list(FORMATS))
def test_wna16_moe_logits_match_transformers(cases: dict[str, SimpleNamespace], name: str) -> None:
    case = cases[name]
    result = load_case({"model": str(case.model), "input_ids": INPUT_IDS})
    torch.testing.assert_close(result["logits"], case.logits, atol=LOGITS_ATOL, rtol=0)
    code_bytes = check_experts(result, case, EXPERTS, INTER, 1)
    # with the scales and byte zero points of groups of 32 inputs (1 per channel), over so small a model
    assert result["expert_bytes"] < (1.3 if case.group == 32 else 1.1) * code_bytes
    router = "model.layers.0.block_sparse_moe.gate" if name.startswith("mixtral") else "model.layers.0.mlp.gate"
    assert result["dtypes"][router] == "torch.float32"  # unquantised, though the config does not name it
    assert result["dtypes"]["model.layers.1.self_attn.qkv_proj"] == "torch.uint8"  # the dense layers' codes


def test_wna16_moe_tensor_and_expert_parallel_logits_match_transformers(cases: dict[str, SimpleNamespace]) -> None:
    """TP 2: every expert on both ranks, its intermediate width halved (a group of 32 per
    rank; per-channel scales with their rows, w2's whole); TP 2 with expert parallelism:
    two whole experts per rank. Each rank holds half the checkpoint's codes."""
    runs = [("gptq4_g32_sym", False), ("awq_g32", False), ("ct8_channel_sym", False), ("ct4_g32_asym", True),
            ("mixtral_gptq4_g32", True)]
    specs = [{"name": f"{name}-{'ep' if ep else 'tp'}", "model": str(cases[name].model), "input_ids": INPUT_IDS,
              "kwargs": {"enable_expert_parallel": ep}} for name, ep in runs]
    for rank_result in run_tp(tp_quant_cases, 2, specs):
        for name, ep in runs:
            result, case = rank_result[f"{name}-{'ep' if ep else 'tp'}"], cases[name]
            torch.testing.assert_close(result["logits"], case.logits, atol=LOGITS_ATOL, rtol=0)
            check_experts(result, case, EXPERTS // 2 if ep else EXPERTS, INTER if ep else INTER // 2, 2, ep)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_wna16_moe_engine_greedy_matches_transformers(cases: dict[str, SimpleNamespace], tp: int) -> None:
    """Through the engine (decode steps' experts in one C call, replayed as CPU graphs)."""
    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    case = cases["gptq4_g32_sym" if tp == 1 else "awq_g32"]
    assert_engine_greedy_matches(case.model, case.hf, prompts, 8, tensor_parallel_size=tp)


@pytest.mark.slow
def test_sleep_and_wake_keep_wna16_experts(cases: dict[str, SimpleNamespace]) -> None:
    """The experts' codes are registered buffers: the worker counts them, level 2 releases
    them with the other weights and waking rebuilds them, and the greedy tokens stay the
    same."""
    from config import SamplingParams
    from tests.test_quant_sleep import assert_sleep_and_wake_keep

    def code_bytes(worker: Any) -> int:
        model = worker.model_runner.model
        return sum(t.numel() * t.element_size() for name, t in model.named_buffers() if "experts.w" in name
                   and name.endswith("_wna16_qweight"))

    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    assert_sleep_and_wake_keep(cases["ct4_g32_asym"].model, prompts,
                               SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), code_bytes)


def test_dummy_load_format_fills_wna16_experts(cases: dict[str, SimpleNamespace]) -> None:
    case = cases["awq_g32"]
    result = load_case({"model": str(case.model), "input_ids": INPUT_IDS, "kwargs": {"load_format": "dummy"}})
    assert result["logits"].isfinite().all()
    # the dummy scales (uniform floats) fit no narrower dtype: float32
    check_experts(result, SimpleNamespace(**{**vars(case), "scale_dtype": torch.float32}), EXPERTS, INTER, 1)


def _variant(case: SimpleNamespace, name: str, drop: str | None = None, **config_fields: Any) -> Path:
    """A copy of `case`'s checkpoint without tensor `drop`, or with quantization_config
    fields replaced."""
    from safetensors.torch import save_file

    out = case.root / name
    out.mkdir()
    save_file({n: t for n, t in case.tensors.items() if n != drop}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((case.model / "config.json").read_text())
    config["quantization_config"].update(config_fields)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def test_wna16_moe_missing_expert_tensor_is_named(cases: dict[str, SimpleNamespace]) -> None:
    name = "model.layers.1.mlp.experts.2.down_proj.qzeros"
    model = _variant(cases["awq_g32"], "missing_qzeros", drop=name)
    kind, message = load_case({"model": str(model), "input_ids": INPUT_IDS, "expect_error": True})["error"]
    assert kind == "WeightLoadError" and name in message, message


@pytest.mark.parametrize("base, fields, needles", [
    ("gptq4_g32_sym", {"desc_act": True}, ("quant_method='gptq'", "desc_act=True", "act-order")),
    ("ct4_g32_asym", _ct(4, 32, False, actorder="group"), ("quant_method='compressed-tensors'", "actorder='group'")),
], ids=["gptq-desc-act", "ct-actorder-group"])
def test_act_order_experts_are_refused_at_resolution(cases: dict[str, SimpleNamespace], base: str, fields: dict,
                                                     needles: tuple[str, ...]) -> None:
    model = _variant(cases[base], f"refused_{base}", **fields)
    with pytest.raises(ConfigError) as raised:
        create_engine_config(model=str(model), device="cpu")
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


@pytest.mark.parametrize("intermediate, tp, sliced, needles", [
    (48, 1, False, ("quantization_config.group_size=32", "moe_intermediate_size=48")),
    (64, 4, True, ("quantization_config.group_size=32", "moe_intermediate_size=64", "tensor_parallel_size=4",
                   "expert parallelism")),
    (36, 1, False, ("36 intermediate features", "multiples of 8")),
], ids=["group-splits-expert", "group-splits-slice", "pack-splits-expert"])
def test_groups_or_packs_that_split_an_expert_or_slice_are_refused(intermediate: int, tp: int, sliced: bool,
                                                                   needles: tuple[str, ...]) -> None:
    layer = torch.nn.Module()
    layer.weight_loader, layer.slice_intermediate, layer.tp_size = None, sliced, tp
    layer.intermediate_size = intermediate
    method = WNA16MoEMethod(WNA16ExpertFormat.gptq(1), 4, 32, "quantization_config.group_size")
    with pytest.raises(ValueError) as raised:
        method.create_weights(layer, 4, HIDDEN, intermediate // tp, torch.float32)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


@pytest.mark.parametrize("name", ["gptq4_g32_sym", "ct8_channel_sym"])
def test_one_call_experts_compute_the_grouped_experts(cases: dict[str, SimpleNamespace], name: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's experts in one C call (kernels/wna16_moe.c, each product the GEMV)
    against the experts grouped in torch (the C call switched off by its token limit), for
    1, 7 and 64 float32 and bfloat16 tokens; an expert id past the model's is named."""
    from models.layers.fused_moe.router import fused_topk
    from models.layers.quantization import wna16_moe

    for dtype, tol in (("float32", 2e-5), ("bfloat16", 2e-2)):
        layer = experts_layer(cases[name].model, dtype)
        for tokens in (1, 7, 64):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, HIDDEN, generator=gen).to(getattr(torch, dtype))
            weights, ids = fused_topk(torch.randn(tokens, EXPERTS, generator=gen), 2, True)
            one_call = layer.quant_method.apply(layer, x, weights, ids)
            grouped = grouped_apply(wna16_moe, layer, x, weights, ids, monkeypatch)
            assert one_call.dtype == x.dtype
            torch.testing.assert_close(one_call.float(), grouped.float(), atol=tol, rtol=tol)
    ids[0, 1] = EXPERTS
    with pytest.raises(ValueError, match=f"outside the model's {EXPERTS} experts"):
        layer.quant_method.apply(layer, x, weights, ids)


def test_wna16_moe_decode_steps_are_recorded_and_replay_eager(cases: dict[str, SimpleNamespace]) -> None:
    """The one-call experts read the routing from tensors: every decode batch size is
    recorded as a CPU graph and replays the eager steps' tokens and logprobs."""
    eager, none = decode_with_graphs(cases["awq_g32"].model, True)
    replayed, sizes = decode_with_graphs(cases["awq_g32"].model, False)
    assert none == [[]] and sizes == [[1, 2, 3]]
    assert replayed == eager


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wna16_moe_on_cuda_matches_the_cpu(cases: dict[str, SimpleNamespace]) -> None:
    """The same experts on CUDA (each product the Triton WNA16 kernel) against the CPU's."""
    from models.layers.fused_moe.router import fused_topk

    case = cases["gptq4_g32_sym"]
    layer = torch.nn.Module()
    layer.weight_loader, layer.expert_map = None, None
    method = WNA16MoEMethod(WNA16ExpertFormat.gptq(1), 4, 32, "quantization_config.group_size")
    method.create_weights(layer, EXPERTS, HIDDEN, INTER, torch.float32)
    prefix = "model.layers.0.mlp.experts"
    for e in range(EXPERTS):
        for suffix in ("qweight", "qzeros", "scales"):
            w13, w2 = getattr(layer, f"w13_{suffix}"), getattr(layer, f"w2_{suffix}")
            gate, up = (case.tensors[f"{prefix}.{e}.{p}_proj.{suffix}"].t() for p in ("gate", "up"))
            w13.data[e] = torch.cat([gate, up])
            w2.data[e] = case.tensors[f"{prefix}.{e}.down_proj.{suffix}"].t()
    method.process_weights_after_loading(layer)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, ids = fused_topk(torch.randn(40, EXPERTS, generator=torch.Generator().manual_seed(2)), 2, True)
    cpu = method.apply(layer, x, weights, ids)
    layer.cuda()
    gpu = method.apply(layer, x.cuda(), weights.cuda(), ids.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=1e-4)
