"""compressed-tensors W8A8 int8 mixture-of-experts checkpoints (RedHatAI's
`Qwen3-30B-A3B-quantized.w8a8` kind) against transformers on the dequantised weights.

The checkpoints: tests/moe_checkpoints.py's tiny random Qwen3-MoE (hidden 64, 2 layers,
4 experts 64 wide, top 2) and a Mixtral of the same size, each expert projection
quantised as llm-compressor's `int-quantized` format stores it (tests/test_quant_w8a8.py's
quantisers: `weight` int8 [out, in], symmetric, `weight_scale` [out, 1] in bfloat16 per
channel, or one float32 value per projection). The routers and the LM head stay float32
(`ignore`); the attention float32 too, or W8A8 as the published checkpoints have it.

The experts quantise their inputs per token to int8 (the layer's tokens, then each
expert's silu(gate) * up), as vLLM's int8 experts and our dense W8A8 layers do; so the
oracle is transformers on the dequantised weights with the same rounding: its experts'
forward replaced by one that rounds both inputs per token (at TP 2 without expert
parallelism, each rank's half of silu(gate) * up with its own scale, as each rank holds
half of the intermediate width), and, where the attention is W8A8, forward pre-hooks on
its projections (tests/test_quant_w8a8.py's). Our int32 sums are exact, so only float
rounding differs, and the logits agree to tests/test_quant_w8a8.py's bounds (2e-3 at TP
1; at TP 2 0.05, as one flipped int8 rounding tie moves the logits by a few 1e-2). Against
plain transformers, the error int8 activations cost (relative L2 < 3%).

At TP 2 each expert's intermediate width is sliced (w13's rows and their scales, w2's
inputs; w2's per-channel scales whole on each rank); under expert parallelism each
rank holds whole experts. Either way each rank holds exactly its share of the
checkpoint's int8 expert bytes, as the checkpoint stores them, with a float32 scale per
row. Also: a decode step's experts in one C call (kernels/int8_moe.c) against the
grouped path and a float64 reference (and, where a GPU exists, the CUDA path against the
CPU's), the engine's greedy tokens, sleep and wake, the dummy load format, a missing
expert scale and a per-tensor scale of several values (named).

And how compressed-tensors places the experts, by expert 0's projection names against
the groups' targets and `ignore` (as vLLM resolves them): in a group of their own beside
the attention's, in full precision where no group targets them or `ignore` names them,
and refused at resolution and again as the loader names them (naming what) where the
names split their projections (as a dense layer's fused modules are) or put them in a
group whose scheme experts cannot take (act-order); loaded where a name takes them out
of such a group.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_tp
from tests.moe_checkpoints import experts_layer, grouped_apply, write_moe_checkpoint
from tests.quant_checkpoints import assert_engine_greedy_matches, hf_logits
from tests.quant_tp_helpers import load_case, tp_quant_cases
from tests.test_quant_fp8_moe import variant
from tests.test_quant_w8a8 import fake_quantize_inputs, quantize_int8_channel, quantize_int8_tensor, w8a8_config
from tests.test_quant_wna16_moe import write_wna16_moe
from tests.wna16_formats import ct_quantization_config, ct_quantizer

FAKE_QUANT_ATOL = {1: 2e-3, 2: 0.05}  # int8 activations, by TP size: the module docstring
REL_TOL = 0.03
INPUT_IDS = torch.randint(3, 320, (12,), generator=torch.Generator().manual_seed(11))
HIDDEN, INTER, EXPERTS = 64, 64, 4
_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x rounded per token to int8 and back, as int8_gemm.quantize_per_token rounds it."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(x / scale).clamp(-127, 127) * scale


def _w8a8_experts_forward(experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor, act_slices: int) -> torch.Tensor:
    """transformers' experts forward (Qwen3MoeExperts, MixtralExperts) with both products'
    inputs rounded per token to int8, silu(gate) * up in `act_slices` slices each with its
    own scale (a TP rank's share of the intermediate width)."""
    out = torch.zeros_like(hidden_states)
    for e in range(experts.num_experts):
        token_idx, pos = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(fake_quant(hidden_states[token_idx]), experts.gate_up_proj[e]).chunk(2, dim=-1)
        act = experts.act_fn(gate) * up
        act = torch.cat([fake_quant(part) for part in act.chunk(act_slices, dim=-1)], dim=-1)
        out.index_add_(0, token_idx, F.linear(act, experts.down_proj[e]) * top_k_weights[token_idx, pos, None])
    return out


def w8a8_reference(hf: Any, attention: bool, tp_size: int, ep: bool) -> Any:
    """`hf` rounding what our W8A8 layers round at `tp_size` (with expert parallelism: whole
    experts per rank): its experts' forward replaced, its attention hooked where W8A8."""
    for name, module in hf.named_modules():
        if name.endswith(".experts"):
            module.forward = functools.partial(_w8a8_experts_forward, module,
                                               act_slices=1 if ep else tp_size)
    if attention:
        fake_quantize_inputs(hf, tp_size)
    return hf


def _config(strategy: str, attention: bool) -> dict[str, Any]:
    config = w8a8_config(strategy)
    config["ignore"] = ["lm_head", "re:.*mlp.gate$", *(() if attention else ("re:.*self_attn.*",))]
    return config


def _quantiser(quantize: Callable, attention: bool) -> Callable:
    def apply(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if not attention and module.rsplit(".", 1)[-1] in _ATTENTION:
            return {"weight": weight}, weight
        return quantize(module, weight)
    return apply


# name -> (family, per-channel (else per tensor), attention quantised too)
FORMATS: dict[str, tuple[str, bool, bool]] = {
    "channel": ("qwen3_moe", True, False),
    "tensor": ("qwen3_moe", False, False),
    "channel_attention": ("qwen3_moe", True, True),
    "mixtral_channel": ("mixtral", True, False),
}


def _transformers(reference: Path) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = hf.config.eos_token_id = None
    return hf


def write_case(root: Path, sources: dict[str, Path], name: str) -> SimpleNamespace:
    """The checkpoint, and transformers' logits on its dequantised weights: plain, and
    rounding as we do at TP 1, TP 2 and TP 2 with expert parallelism."""
    from safetensors.torch import save_file

    family, per_channel, attention = FORMATS[name]
    quantize = _quantiser(quantize_int8_channel if per_channel else quantize_int8_tensor, attention)
    tensors, dequantised = write_wna16_moe(sources[family], root / name, quantize,
                                           _config("channel" if per_channel else "tensor", attention))
    reference = root / f"{name}-reference"
    reference.mkdir()
    save_file(dequantised, str(reference / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(sources[family] / "config.json", reference / "config.json")
    logits = {(tp, ep): hf_logits(w8a8_reference(_transformers(reference), attention, tp, ep), INPUT_IDS)
              for tp, ep in ((1, False), (2, False), (2, True))}
    code_bytes = sum(t.numel() for n, t in tensors.items() if _EXPERT_TENSOR.search(n) and n.endswith(".weight"))
    return SimpleNamespace(root=root, model=root / name, name=name, reference=reference, logits=logits,
                           plain=hf_logits(_transformers(reference), INPUT_IDS), tensors=tensors,
                           attention=attention, code_bytes=code_bytes)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("w8a8_moe")
    sources = {"qwen3_moe": write_moe_checkpoint(root / "qwen3", "qwen3_moe", seed=8, moe_intermediate_size=INTER),
               "mixtral": write_moe_checkpoint(root / "mixtral", "mixtral", seed=9, intermediate_size=INTER)}
    return {name: write_case(root, sources, name) for name in FORMATS}


def check_experts(result: dict[str, Any], code_bytes: int, num_local: int, inter: int, ranks: int,
                  ep: bool = False) -> None:
    """Every FusedMoE holds its experts as the checkpoint stores them, int8 with a float32
    scale per row, and nothing else (no float weight); the int8 bytes exactly this rank's
    share of the checkpoint's."""
    expected = {"w13_weight": ("torch.int8", (num_local, 2 * inter, HIDDEN)),
                "w2_weight": ("torch.int8", (num_local, HIDDEN, inter)),
                "w13_weight_scale": ("torch.float32", (num_local, 2 * inter, 1)),
                "w2_weight_scale": ("torch.float32", (num_local, HIDDEN, 1))}
    assert len(result["experts"]) == 2
    for held in result["experts"].values():
        assert held == expected
    weights = 2 * num_local * 3 * inter * HIDDEN
    expert_map = 2 * EXPERTS * 8 if ep else 0  # under EP each layer also holds its map of the experts (int64)
    scales = 2 * num_local * (2 * inter + HIDDEN) * 4
    assert result["expert_bytes"] == weights + scales + expert_map
    assert weights == code_bytes // ranks


@pytest.mark.parametrize("name", list(FORMATS))
def test_w8a8_moe_logits_match_transformers(cases: dict[str, SimpleNamespace], name: str) -> None:
    case = cases[name]
    result = load_case({"model": str(case.model), "input_ids": INPUT_IDS})
    torch.testing.assert_close(result["logits"], case.logits[1, False], atol=FAKE_QUANT_ATOL[1], rtol=0)
    rel = ((result["logits"] - case.plain).norm() / case.plain.norm()).item()
    assert rel < REL_TOL, rel
    check_experts(result, case.code_bytes, EXPERTS, INTER, 1)
    router = "model.layers.0.block_sparse_moe.gate" if name.startswith("mixtral") else "model.layers.0.mlp.gate"
    assert result["dtypes"][router] == "torch.float32"
    attention = result["dtypes"]["model.layers.1.self_attn.qkv_proj"]
    assert attention == ("torch.int8" if case.attention else "torch.float32")


def test_w8a8_moe_tensor_and_expert_parallel_logits_match_transformers(cases: dict[str, SimpleNamespace]) -> None:
    """TP 2: every expert on both ranks, its intermediate width halved (per-channel and
    per-tensor scales with their rows, w2's whole; each rank rounds its half of the
    activations); TP 2 with expert parallelism: two whole experts per rank. Each rank
    holds half the checkpoint's int8 expert bytes."""
    runs = [("channel", False), ("tensor", False), ("channel_attention", False), ("channel", True),
            ("mixtral_channel", True)]
    specs = [{"name": f"{name}-{'ep' if ep else 'tp'}", "model": str(cases[name].model), "input_ids": INPUT_IDS,
              "kwargs": {"enable_expert_parallel": ep}} for name, ep in runs]
    for rank_result in run_tp(tp_quant_cases, 2, specs):
        for name, ep in runs:
            result, case = rank_result[f"{name}-{'ep' if ep else 'tp'}"], cases[name]
            torch.testing.assert_close(result["logits"], case.logits[2, ep], atol=FAKE_QUANT_ATOL[2], rtol=0)
            # and nearer it than the other placement's rounding (whole activations against
            # halves differ by ~0.02, within that bound; a flipped tie moves few logits)
            error, other = ((result["logits"] - case.logits[2, e]).abs().median().item() for e in (ep, not ep))
            assert error < 0.1 * other, (name, ep, error, other)
            check_experts(result, case.code_bytes, EXPERTS // 2 if ep else EXPERTS, INTER if ep else INTER // 2, 2,
                          ep)


def _dequantised_experts(case: SimpleNamespace, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s experts from the checkpoint, dequantised: w13 [E, 2I, H], w2 [E, H, I]."""
    prefix = f"model.layers.{layer}.mlp.experts"

    def weight(name: str) -> torch.Tensor:
        return case.tensors[f"{name}.weight"].double() * case.tensors[f"{name}.weight_scale"].double().reshape(-1, 1)

    w13 = torch.stack([torch.cat([weight(f"{prefix}.{e}.gate_proj"), weight(f"{prefix}.{e}.up_proj")])
                       for e in range(EXPERTS)])
    return w13, torch.stack([weight(f"{prefix}.{e}.down_proj") for e in range(EXPERTS)])


def _reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
    """The W8A8 experts token by token: each product's input rounded per token to int8
    (in float32, as ours), the products in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = fake_quant(x[t : t + 1].float()).double()
        for j in range(ids.shape[1]):
            gate_up = xq @ w13[int(ids[t, j])].t()
            act = (F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]).float()
            out[t] += float(weights[t, j]) * (fake_quant(act).double() @ w2[int(ids[t, j])].t())[0]
    return out


@pytest.mark.parametrize("name", ["channel", "tensor"])
def test_one_call_experts_compute_the_grouped_experts(cases: dict[str, SimpleNamespace], name: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's experts in one C call (kernels/int8_moe.c) against the experts
    grouped in torch (the C call switched off by its token limit) and against the
    experts token by token in float64, for 1, 7 and 64 float32 and bfloat16 tokens; an
    expert id past the model's is named."""
    from models.layers.fused_moe.router import fused_topk
    from models.layers.quantization import int8_moe

    w13, w2 = _dequantised_experts(cases[name], 0)
    for dtype in ("float32", "bfloat16"):
        layer = experts_layer(cases[name].model, dtype)
        for tokens in (1, 7, 64):
            gen = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, HIDDEN, generator=gen).to(getattr(torch, dtype))
            weights, ids = fused_topk(torch.randn(tokens, EXPERTS, generator=gen), 2, True)
            one_call = layer.quant_method.apply(layer, x, weights, ids)
            grouped = grouped_apply(int8_moe, layer, x, weights, ids, monkeypatch)
            reference = _reference_experts(x, w13, w2, weights, ids)
            assert one_call.dtype == x.dtype
            # float32: the same int8 values but where float rounding flips a tie (one int8
            # step of an activation); bfloat16: the grouped path rounds its products to it
            atol = (2e-3 if dtype == "float32" else 3e-2) * reference.abs().max().item()
            torch.testing.assert_close(one_call.double(), reference, atol=atol, rtol=0)
            torch.testing.assert_close(grouped.double(), reference, atol=atol, rtol=0)
    ids[0, 1] = EXPERTS
    with pytest.raises(ValueError, match=f"outside the model's {EXPERTS} experts"):
        layer.quant_method.apply(layer, x, weights, ids)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_one_call_experts_of_other_builds(cases: dict[str, SimpleNamespace], isa: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """int8_moe.c built for Haswell (AVX2 without VNNI: each expert's products through the
    AVX2 GEMM in turn) gives this machine's build's values; built without -march (no
    int8 GEMM) it declines (status -2) and the experts are grouped in torch instead."""
    from distributed.native_build import cpu_flags, load_kernel
    from models.layers.fused_moe.moe_method import bind_one_call, one_call_experts
    from models.layers.fused_moe.router import fused_topk
    from models.layers.quantization import int8_gemm, int8_moe

    if isa == "avx2" and "avx2" not in cpu_flags().split():
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    flags = (tuple("-march=haswell" if f == "-march=native" else f for f in int8_gemm.COMPILE_FLAGS) if isa == "avx2"
             else ("-O2", "-ffp-contract=off", "-fopenmp", "-fPIC"))
    kernel = load_kernel(int8_gemm.SOURCES, flags, int8_gemm.LINK_FLAGS, ("-lm",), int8_gemm.Int8Kernel, "%s")
    assert kernel is not None and kernel.has_gemm == (isa == "avx2") and not kernel.gemm_vnni
    layer = experts_layer(cases["channel"].model, "float32")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, HIDDEN, generator=gen)
    weights, ids = fused_topk(torch.randn(7, EXPERTS, generator=gen), 2, True)
    expected = layer.quant_method.apply(layer, x, weights, ids)
    entry = bind_one_call(kernel.lib, "int8_moe", int8_moe._WEIGHT_ARGTYPES)
    got = one_call_experts(entry, layer.quant_method._weight_args(layer), x, 0, weights, ids, None, EXPERTS, EXPERTS,
                           "int8 experts")
    if isa == "portable":
        assert got is None
        monkeypatch.setattr(int8_moe, "load", lambda: kernel)
        got = layer.quant_method.apply(layer, x, weights, ids)  # grouped
    torch.testing.assert_close(got, expected, atol=2e-3 * expected.abs().max().item(), rtol=0)


def test_w8a8_moe_decode_steps_are_recorded_and_replay_eager(cases: dict[str, SimpleNamespace]) -> None:
    """The one-call experts read the routing from tensors: every decode batch size is
    recorded as a CPU graph and replays the eager steps' tokens and logprobs."""
    from tests.moe_checkpoints import decode_with_graphs

    eager, none = decode_with_graphs(cases["channel"].model, True)
    replayed, sizes = decode_with_graphs(cases["channel"].model, False)
    assert none == [[]] and sizes == [[1, 2, 3]]
    assert replayed == eager


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_w8a8_moe_on_cuda_matches_the_cpu(cases: dict[str, SimpleNamespace]) -> None:
    """The same loaded experts moved to CUDA (each product torch._int_mm, cuBLASLt's int8
    GEMM) against the CPU's, for a prefill's 40 tokens: the same int32 sums."""
    from models.layers.fused_moe.router import fused_topk

    layer = experts_layer(cases["channel"].model, "float32")
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, ids = fused_topk(torch.randn(40, EXPERTS, generator=torch.Generator().manual_seed(2)), 2, True)
    cpu = layer.quant_method.apply(layer, x, weights, ids)
    layer.cuda()
    gpu = layer.quant_method.apply(layer, x.cuda(), weights.cuda(), ids.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=2e-3 * cpu.abs().max().item(), rtol=0)


@pytest.mark.slow
def test_w8a8_moe_engine_greedy_matches_transformers(cases: dict[str, SimpleNamespace]) -> None:
    """Through the engine (decode steps' experts in one C call, replayed as CPU graphs)
    against transformers rounding as we do at TP 1."""
    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    case = cases["channel"]
    hf = w8a8_reference(_transformers(case.reference), False, 1, False)
    assert_engine_greedy_matches(case.model, hf, prompts, 8)


@pytest.mark.slow
def test_sleep_and_wake_keep_w8a8_experts(cases: dict[str, SimpleNamespace]) -> None:
    """The experts' int8 weights are registered parameters: the worker counts them, level
    2 releases them with the other weights and waking restores them, and the greedy
    tokens stay the same."""
    from config import SamplingParams
    from tests.test_quant_sleep import assert_sleep_and_wake_keep

    def int8_bytes(worker: Any) -> int:
        model = worker.model_runner.model
        return sum(t.numel() for name, t in model.named_parameters() if "experts.w" in name and t.dtype == torch.int8)

    prompts = [[5, 17, 33, 71, 9], [100, 3, 250, 41, 8, 60, 77, 12, 300]]
    assert_sleep_and_wake_keep(cases["channel_attention"].model, prompts,
                               SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), int8_bytes)


def test_dummy_load_format_fills_w8a8_experts(cases: dict[str, SimpleNamespace]) -> None:
    case = cases["channel"]
    result = load_case({"model": str(case.model), "input_ids": INPUT_IDS, "kwargs": {"load_format": "dummy"}})
    assert result["logits"].isfinite().all()
    check_experts(result, case.code_bytes, EXPERTS, INTER, 1)


def test_w8a8_moe_missing_expert_scale_is_named(cases: dict[str, SimpleNamespace]) -> None:
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    model = variant(cases["channel"], "missing_scale", drop=name)
    kind, message = load_case({"model": str(model), "input_ids": INPUT_IDS, "expect_error": True})["error"]
    assert kind == "WeightLoadError" and name in message, message


def test_w8a8_moe_per_tensor_scale_of_several_values_is_named(cases: dict[str, SimpleNamespace]) -> None:
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale"
    model = variant(cases["tensor"], "two_value_scale", replace={name: torch.ones(2)})
    kind, message = load_case({"model": str(model), "input_ids": INPUT_IDS, "expect_error": True})["error"]
    assert kind == "WeightLoadError" and name in message and "one value" in message, message


# ------------------------------------------------------------------ the experts placed by name


def _mixed_config(attention: dict[str, Any] | None, experts: dict[str, Any] | None) -> dict[str, Any]:
    """A compressed-tensors config of one group per part, each with its own format:
    `attention` targets the attention projections, `experts` the experts' (each a group
    spec as `w8a8_config`'s or `ct_quantization_config`'s "group_0", or None)."""
    groups = {}
    if attention is not None:
        groups["attention"] = {**attention, "targets": ["re:.*self_attn.*"]}
    if experts is not None:
        groups["experts"] = {**experts, "targets": ["re:.*experts.*"]}
    return {"quant_method": "compressed-tensors", "quantization_status": "compressed", "config_groups": groups,
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


def _by_part(attention: Callable | None, experts: Callable | None) -> Callable:
    """A quantiser applying `attention` to the attention projections and `experts` to the
    experts' (None: the weight kept as it is)."""
    def apply(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        quantize = experts if _EXPERT_TENSOR.search(module + ".") else attention
        return quantize(module, weight) if quantize is not None else ({"weight": weight}, weight)
    return apply


def _write_by_name(cases: dict[str, SimpleNamespace], name: str, quantize: Callable,
                   config: dict[str, Any]) -> SimpleNamespace:
    """The Qwen3-MoE source written with `quantize` and `config`, and the directory of its
    dequantised weights for transformers."""
    from safetensors.torch import save_file

    root = cases["channel"].root
    source = root / "qwen3"
    tensors, dequantised = write_wna16_moe(source, root / name, quantize, config)
    reference = root / f"{name}-reference"
    reference.mkdir()
    save_file(dequantised, str(reference / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(source / "config.json", reference / "config.json")
    return SimpleNamespace(model=root / name, tensors=tensors, reference=reference)


def _int8_group() -> dict[str, Any]:
    return {**w8a8_config()["config_groups"]["group_0"], "format": "int-quantized"}


def _int4_group(actorder: str | None = None) -> dict[str, Any]:
    return ct_quantization_config(4, 32, True, actorder)["config_groups"]["group_0"]


def _act_order_linear_group() -> dict[str, Any]:
    """The experts' W8A8 group (by regex) beside a W4A16 act-order group targeting every Linear."""
    config = _mixed_config(None, _int8_group())
    config["config_groups"]["group_0"] = {**_int4_group("group"), "targets": ["Linear"]}
    return config


@pytest.mark.parametrize("name, act_order, config", [
    ("experts_group", False, _mixed_config(_int4_group(), _int8_group())),
    ("experts_out_of_act_order", True, _act_order_linear_group()),
], ids=["beside-the-attention's", "out-of-an-act-order-linear-group"])
def test_experts_in_a_group_of_their_own(cases: dict[str, SimpleNamespace], name: str, act_order: bool,
                                         config: dict[str, Any]) -> None:
    """A group targeting the experts by regex (W8A8 int8) beside one for the attention
    (W4A16, groups of 32), or beside a W4A16 act-order group targeting every Linear, which
    experts cannot take: each part takes its group's layout, as vLLM resolves the experts
    by expert 0's projection names, and the act-order group does not refuse experts it
    does not hold (the engine's resolution and the model's build judge the experts by
    the architecture's names too)."""
    case = _write_by_name(cases, name, _by_part(ct_quantizer(4, 32, True, actorder_group=act_order),
                                                quantize_int8_channel), config)
    result = load_case({"model": str(case.model), "input_ids": INPUT_IDS})
    # the attention weight-only, the experts rounding their inputs as at TP 1
    expected = hf_logits(w8a8_reference(_transformers(case.reference), False, 1, False), INPUT_IDS)
    torch.testing.assert_close(result["logits"], expected, atol=FAKE_QUANT_ATOL[1], rtol=0)
    code_bytes = sum(t.numel() for n, t in case.tensors.items() if _EXPERT_TENSOR.search(n) and n.endswith(".weight"))
    check_experts(result, code_bytes, EXPERTS, INTER, 1)
    assert result["dtypes"]["model.layers.0.self_attn.qkv_proj"] == "torch.uint8"  # 4-bit codes


@pytest.mark.parametrize("name, config", [
    ("untargeted", _mixed_config(_int8_group(), None)),
    ("ignored", {**w8a8_config(), "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*experts.*"]}),
])
def test_experts_no_group_quantises_stay_in_full_precision(cases: dict[str, SimpleNamespace], name: str,
                                                           config: dict[str, Any]) -> None:
    """Experts that no group targets, or that `ignore` names, are read as the float
    weights the checkpoint holds (the attention W8A8 int8), not refused."""
    case = _write_by_name(cases, f"float_experts_{name}", _by_part(quantize_int8_channel, None), config)
    result = load_case({"model": str(case.model), "input_ids": INPUT_IDS})
    hf = _transformers(case.reference)
    fake_quantize_inputs(hf, 1)  # the W8A8 attention's rounding (the experts are not hooked: not nn.Linear)
    torch.testing.assert_close(result["logits"], hf_logits(hf, INPUT_IDS), atol=FAKE_QUANT_ATOL[1], rtol=0)
    for held in result["experts"].values():
        assert held == {"w13_weight": ("torch.float32", (EXPERTS, 2 * INTER, HIDDEN)),
                        "w2_weight": ("torch.float32", (EXPERTS, HIDDEN, INTER))}
    assert result["dtypes"]["model.layers.0.self_attn.qkv_proj"] == "torch.int8"


_OUT_OF_REACH = pytest.mark.parametrize("config, needles", [
    ({**w8a8_config(), "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*experts.*down_proj"]},
     ("experts.0.gate_proj", "experts.0.down_proj", "partly ignored")),
    (_mixed_config(None, _int4_group("group")), ("config_groups.experts.weights.actorder='group'", "act-order")),
], ids=["partly-ignored", "act-order-group"])


@_OUT_OF_REACH
def test_experts_a_name_puts_out_of_reach_are_refused_at_resolution(cases: dict[str, SimpleNamespace],
                                                                    config: dict[str, Any],
                                                                    needles: tuple[str, ...]) -> None:
    """A ConfigError naming the projections or the group's setting before any worker
    starts: the architecture's expert names (expert 0's in each sparse layer) are
    resolved against the groups as the loader will resolve them."""
    from config import ConfigError

    out = cases["channel"].root / f"refused_{needles[-1].replace(' ', '_').replace('-', '_')}"
    shutil.copytree(cases["channel"].model, out)
    written = json.loads((out / "config.json").read_text())
    written["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(written))
    with pytest.raises(ConfigError) as raised:
        load_case({"model": str(out), "input_ids": INPUT_IDS, "expect_error": True})
    for needle in ("quant_method='compressed-tensors'", *needles):
        assert needle in str(raised.value), (needle, str(raised.value))


@_OUT_OF_REACH
def test_experts_a_name_puts_out_of_reach_are_refused_as_the_loader_names_them(config: dict[str, Any],
                                                                              needles: tuple[str, ...]) -> None:
    """The loader's own check (for an architecture the engine did not judge): a
    ValueError naming the same, as it asks again with the layer's name."""
    from models.layers.quantization.compressed_tensors.config import CompressedTensorsConfig

    quant = CompressedTensorsConfig.from_config(config)
    with pytest.raises(ValueError) as raised:
        quant.get_moe_method(torch.nn.Module(), "model.layers.0.mlp.experts")
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


def test_a_fused_layer_partly_ignored_is_refused_naming_its_modules() -> None:
    """The dense layers' rule the experts' shares: the checkpoint modules one layer fuses
    fall in one group (or are all ignored)."""
    from models.layers.quantization.compressed_tensors.config import CompressedTensorsConfig

    config = CompressedTensorsConfig.from_config({**w8a8_config(), "ignore": ["lm_head", "re:.*q_proj$"]})
    packed = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    with pytest.raises(ValueError, match=r"self_attn\.q_proj.*which model\.layers\.0\.self_attn\.qkv_proj fuses.*"
                                         r"partly ignored"):
        config.get_linear_method(torch.nn.Module(), "model.layers.0.self_attn.qkv_proj", packed)
    assert config.get_linear_method(torch.nn.Module(), "model.layers.0.self_attn.o_proj", packed) is not None
