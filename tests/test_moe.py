"""Mixture of experts: the FusedMoE kernels, expert placement, loading, and generation
against transformers for Mixtral and Qwen3-MoE at TP 1 and 2, with and without expert
parallelism.

Kernels are checked against a float64 per-token loop; the in-process loading tests
install a TP group of size 2 whose communicator must never be used (loading is
collective-free), so one process can play rank 0 or rank 1 and show what that rank
holds and which checkpoint tensors it reads. The engine tests (one module-scoped engine
per case) compare greedy tokens and logprobs with transformers' `generate`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from config import SamplingParams
from distributed import set_tensor_parallel_group
from engine.arg_utils import create_engine_config
from engine.core import EngineCore
from models.errors import WeightLoadError
from models.layers.fused_moe import ExpertParallelConfigError, determine_expert_placement, fused_topk
from models.layers import cpu_sgemm
from models.layers.cpu_gemm import widens_half_dtype
from models.layers.fused_moe import grouped_moe
from models.layers.fused_moe.grouped_moe import grouped_fused_experts
from tests.hf_checkpoints import assert_logprobs_match, hf_prompt_logprobs
from tests.moe_checkpoints import (edit_config, expert_shapes_on_rank, expert_tensor_names, naive_moe_reference,
                                   write_moe_checkpoint)
import tests.test_generation as generation
from tests.test_generation import MAX_NEW, _hf_model, engine_config, hf_greedy, make_prompts

# ---------------------------------------------------------------------- helpers


class _NoCollectives:
    """The communicator of a pretend TP group: loading must not call any collective."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a collective ({name}) was called while building or loading the model")


@contextlib.contextmanager
def as_tp_rank(rank: int, world_size: int) -> Iterator[None]:
    set_tensor_parallel_group(rank, world_size, _NoCollectives())
    try:
        yield
    finally:
        set_tensor_parallel_group(0, 1, None)


def load_on_rank(model_dir: Path, rank: int, world_size: int, **kwargs: Any) -> torch.nn.Module:
    from model_loader import get_model

    config = create_engine_config(model=str(model_dir), device="cpu", dtype="float32", use_tqdm_on_load=False,
                                  tensor_parallel_size=world_size, **kwargs)
    with as_tp_rank(rank, world_size):
        return get_model(config)


def random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return fused_topk(torch.randn(num_tokens, num_experts, generator=gen), top_k, renormalize=True)


def random_experts(num_experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2,
            torch.randn(num_experts, hidden, inter, generator=gen) * 0.2)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints written by transformers: Mixtral with 4 experts; Qwen3-MoE with 8,
    norm_topk_prob on and a dense first layer (mlp_only_layers); Qwen3-MoE with 4,
    norm_topk_prob off and decoder_sparse_step 2 (layer 0 dense, layer 1 sparse)."""
    root = tmp_path_factory.mktemp("moe")
    return {
        "mixtral": write_moe_checkpoint(root / "mixtral", "mixtral", seed=1),
        "qwen3_moe": write_moe_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=2, num_experts=8,
                                          mlp_only_layers=[0]),
        "qwen3_moe_step2": write_moe_checkpoint(root / "qwen3_moe_step2", "qwen3_moe", seed=3,
                                                norm_topk_prob=False, decoder_sparse_step=2),
    }


# ---------------------------------------------------------------------- router and kernels


def test_router_renormalises_per_family() -> None:
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(0))
    # Mixtral: the top-k weights are the softmax over the top-k logits.
    weights, ids = fused_topk(logits, 2, renormalize=True)
    top_logits, top_ids = torch.topk(logits, 2, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top_logits, dim=-1))
    # Qwen3-MoE without norm_topk_prob: the softmax over all experts, kept as they are.
    weights, ids = fused_topk(logits, 2, renormalize=False)
    torch.testing.assert_close(weights, torch.softmax(logits, dim=-1).gather(1, top_ids))
    with pytest.raises(ValueError, match="num_experts_per_tok=7"):
        fused_topk(logits, 7, renormalize=True)


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_grouped_kernel_matches_per_token_reference(num_tokens: int) -> None:
    w13, w2 = random_experts(6, 24, 16, seed=num_tokens)
    weights, ids = random_routing(num_tokens, 6, 2, seed=num_tokens)
    hidden = torch.randn(num_tokens, 24, generator=torch.Generator().manual_seed(7))
    out = grouped_fused_experts(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), naive_moe_reference(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_grouped_kernel_computes_only_local_experts_under_ep() -> None:
    w13, w2 = random_experts(6, 24, 16, seed=1)
    weights, ids = random_routing(29, 6, 3, seed=2)
    hidden = torch.randn(29, 24, generator=torch.Generator().manual_seed(3))
    placement = determine_expert_placement(6, enable_expert_parallel=False)
    assert placement.num_local_experts == 6
    partials = []
    for first in (0, 3):  # rank 0 holds experts 0-2, rank 1 experts 3-5
        expert_map = torch.full((6,), -1, dtype=torch.int64)
        expert_map[first:first + 3] = torch.arange(3)
        local = slice(first, first + 3)
        out = grouped_fused_experts(hidden, w13[local], w2[local], weights, ids, expert_map)
        ref = naive_moe_reference(hidden, w13[local], w2[local], weights, ids, {first + i: i for i in range(3)})
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        partials.append(out)
    # The all-reduce of the two ranks' partial sums is the whole layer.
    torch.testing.assert_close(partials[0] + partials[1], grouped_fused_experts(hidden, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("switch", ["1", "0"], ids=["kernel-on", "TP_CPU_BF16_GEMM=0"])
def test_bf16_experts_take_the_product_a_bf16_dense_layer_takes(monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    """On a CPU whose oneDNN has no bf16 GEMM (AVX2), bf16 experts go through our AVX2
    kernel (`cpu_sgemm.linear_half`) as the dense layers do, 2 calls per active expert,
    rather than torch's product, which converts the weight on every call there; on other
    CPUs, and wherever `TP_CPU_BF16_GEMM=0` turns the dense layers' kernel off, F.linear.
    Either way the float64 reference on the bf16 values, to bf16 rounding (the gate/up
    products, the activation and the outputs each rounded once)."""
    monkeypatch.setenv("TP_CPU_BF16_GEMM", switch)
    w13, w2 = (w.bfloat16() for w in random_experts(6, 64, 40, seed=5))
    weights, ids = random_routing(11, 6, 2, seed=6)
    hidden = torch.randn(11, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    calls = []
    real_half = cpu_sgemm.linear_half
    monkeypatch.setattr(cpu_sgemm, "linear_half", lambda x, w, *a: calls.append(x.shape[0]) or real_half(x, w, *a))
    out = grouped_fused_experts(hidden, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    assert len(calls) == (2 * ids.unique().numel() if widens_half_dtype(torch.bfloat16) else 0)
    if switch == "0":
        assert not calls
    ref = naive_moe_reference(hidden, w13, w2, weights, ids)
    assert ((out.double() - ref).abs() <= 4 * 2.0 ** -8 * ref.abs().amax(-1, keepdim=True) + 1e-6).all()


def test_grouped_kernel_runs_one_gemm_pair_per_active_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = random_experts(8, 16, 8, seed=4)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    logits[:, 7] = float("-inf")  # expert 7 is never chosen: no GEMM for it
    weights, ids = fused_topk(logits, 2, renormalize=True)
    calls = []
    real_linear = grouped_moe.F.linear
    monkeypatch.setattr(grouped_moe.F, "linear", lambda x, w, *a: calls.append(x.shape[0]) or real_linear(x, w, *a))
    grouped_fused_experts(torch.randn(64, 16), w13, w2, weights, ids)
    active = ids.unique().numel()
    assert active == 7
    assert len(calls) == 2 * active  # no per-token loop: one gate/up and one down GEMM per expert
    assert sum(calls) == 2 * ids.numel()  # every (token, expert) pair computed once


# (tokens, experts, top_k, local experts or None): one block per expert; several blocks
# per expert with an expert never chosen; expert parallelism holding experts 2 and 3.
TRITON_CASES = [(13, 4, 2, None), (40, 6, 3, None), (13, 4, 2, (2, 4))]


@pytest.mark.parametrize("case", TRITON_CASES, ids=["one-block", "many-blocks", "expert-parallel"])
def test_triton_kernel_matches_reference_under_interpreter(case: tuple) -> None:
    from models.layers.fused_moe.fused_moe_triton import triton_fused_experts

    num_tokens, num_experts, top_k, local_range = case
    w13, w2 = random_experts(num_experts, 32, 24, seed=6)
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(7))
    if num_experts > 4:
        logits[:, -1] = float("-inf")  # an expert with no tokens: no block for it
    weights, ids = fused_topk(logits, top_k, renormalize=True)
    hidden = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(8))
    expert_map, local, local_of_global = None, slice(0, num_experts), None
    if local_range is not None:
        first, end = local_range
        expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
        expert_map[first:end] = torch.arange(end - first)
        local, local_of_global = slice(first, end), {first + i: i for i in range(end - first)}
    out = triton_fused_experts(hidden, w13[local], w2[local], weights, ids, expert_map)
    ref = naive_moe_reference(hidden, w13[local], w2[local], weights, ids, local_of_global)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_on_cuda_matches_cpu_and_captures_in_a_cuda_graph(dtype: torch.dtype) -> None:
    from models.layers.fused_moe.fused_moe_triton import triton_fused_experts

    w13, w2 = random_experts(8, 256, 128, seed=9)
    weights, ids = random_routing(100, 8, 2, seed=10)
    hidden = torch.randn(100, 256, generator=torch.Generator().manual_seed(11))
    ref = grouped_fused_experts(hidden.to(dtype).float(), w13.to(dtype).float(), w2.to(dtype).float(), weights, ids)
    args = [t.cuda() for t in (hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]
    out = triton_fused_experts(*args)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no host synchronisation inside
        captured = triton_fused_experts(*args)
    args[4].copy_(args[4].flip(0))  # new routing, same buffers
    graph.replay()
    torch.testing.assert_close(captured, triton_fused_experts(*args), atol=tol, rtol=tol)


# ---------------------------------------------------------------------- placement and loading


def test_expert_placement_splits_whole_experts_over_ranks() -> None:
    with as_tp_rank(1, 2):
        placement = determine_expert_placement(8, enable_expert_parallel=True)
        assert determine_expert_placement(8, enable_expert_parallel=False).num_local_experts == 8
    assert (placement.first_local_expert, placement.num_local_experts) == (4, 4)
    assert placement.expert_map().tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert placement.is_local_checkpoint_tensor("model.layers.3.mlp.experts.5.up_proj.weight")
    assert not placement.is_local_checkpoint_tensor("model.layers.3.mlp.experts.3.up_proj.weight")
    assert placement.is_local_checkpoint_tensor("model.layers.3.mlp.gate.weight")


def test_expert_parallel_refuses_experts_not_divisible_by_tp(moe_models: dict[str, Path]) -> None:
    with as_tp_rank(0, 3), pytest.raises(ExpertParallelConfigError, match=r"num_experts=8.*tensor_parallel_size=3"):
        determine_expert_placement(8, enable_expert_parallel=True)
    # Through the model: 4 Mixtral experts over 3 ranks (4 heads allow no TP 3 engine,
    # so the model is built directly as rank 0 of 3).
    from model_loader.utils import initialize_model

    config = create_engine_config(model=str(moe_models["mixtral"]), device="cpu", dtype="float32", enable_expert_parallel=True)
    with as_tp_rank(0, 3), pytest.raises(ExpertParallelConfigError, match=r"num_experts=4.*tensor_parallel_size=3"):
        initialize_model(config)


def test_resolution_refuses_expert_sizes_the_tp_size_cannot_split(moe_models: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """Refused before any worker starts, naming the field: experts over ranks under EP,
    the experts' intermediate size over ranks under TP."""
    import json
    import shutil

    from config import ConfigError

    model_dir = Path(shutil.copytree(moe_models["mixtral"], tmp_path / "m"))
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 6}))
    with pytest.raises(ConfigError, match=r"num_experts=6 .* not divisible by tensor_parallel_size=4"):
        create_engine_config(model=str(model_dir), device="cpu", tensor_parallel_size=4, enable_expert_parallel=True)
    (model_dir / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 30}))
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 does not divide the experts' intermediate size 30"):
        create_engine_config(model=str(model_dir), device="cpu", tensor_parallel_size=4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_each_rank_holds_and_reads_only_its_experts(family: str, moe_models: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import model_loader.safetensors_reader as reader

    model_dir = moe_models[family]
    all_names = expert_tensor_names(model_dir)
    checkpoint = load_file(str(next(model_dir.glob("*.safetensors"))))
    num_experts = 4 if family == "mixtral" else 8
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    inter = 32
    sparse_layer = 1  # a sparse layer in both checkpoints
    opened: list[str] = []  # every tensor the safetensors reader makes out of file bytes
    real = reader._tensor_from_buffer
    monkeypatch.setattr(reader, "_tensor_from_buffer",
                        lambda buf, entry, base=0: opened.append(entry.name) or real(buf, entry, base))
    for rank in range(2):
        opened.clear()
        model = load_on_rank(model_dir, rank, 2, enable_expert_parallel=True)
        local = range(rank * num_experts // 2, (rank + 1) * num_experts // 2)
        experts = getattr(model.model.layers[sparse_layer], block).experts
        assert tuple(experts.w13_weight.shape) == (num_experts // 2, 2 * inter, 64)
        assert tuple(experts.w2_weight.shape) == (num_experts // 2, 64, inter)
        opened_experts = sorted(n for n in opened if ".experts." in n)
        assert opened_experts == [n for n in all_names if int(n.split(".experts.")[1].split(".")[0]) in local]
        prefix = f"model.layers.{sparse_layer}.{block}.experts"
        for i, expert in enumerate(local):  # whole experts, unsliced
            torch.testing.assert_close(experts.w13_weight[i, :inter], checkpoint[f"{prefix}.{expert}.{gate}.weight"])
        del model
    # Without expert parallelism every rank holds every expert, its intermediate dim halved.
    model = load_on_rank(model_dir, 1, 2)
    experts = getattr(model.model.layers[sparse_layer], block).experts
    assert tuple(experts.w13_weight.shape) == (num_experts, 2 * inter // 2, 64)
    assert tuple(experts.w2_weight.shape) == (num_experts, 64, inter // 2)
    half = slice(inter // 2, inter)  # rank 1's half of expert 2's intermediate dim
    torch.testing.assert_close(experts.w13_weight[2, :inter // 2], checkpoint[f"{prefix}.2.{gate}.weight"][half])
    torch.testing.assert_close(experts.w13_weight[2, inter // 2:], checkpoint[f"{prefix}.2.{up}.weight"][half])
    torch.testing.assert_close(experts.w2_weight[2], checkpoint[f"{prefix}.2.{down}.weight"][:, half])


def rewritten_checkpoint(source: Path, out_dir: Path, drop: str | None = None, add: str | None = None) -> Path:
    """A copy of `source` with one tensor left out and/or one stray tensor added."""
    out_dir.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (out_dir / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(next(source.glob("*.safetensors"))))
    if drop is not None:
        del tensors[drop]
    if add is not None:
        tensors[add] = torch.zeros(3)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def test_missing_expert_tensor_is_named(moe_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = rewritten_checkpoint(moe_models["qwen3_moe"], tmp_path / "broken",
                                     drop="model.layers.1.mlp.experts.6.up_proj.weight")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.6\.up_proj\.weight"):
        load_on_rank(model_dir, 0, 1)
    # Under expert parallelism only the rank that holds expert 6 misses it.
    with pytest.raises(WeightLoadError, match=r"experts\.6\.up_proj"):
        load_on_rank(model_dir, 1, 2, enable_expert_parallel=True)
    load_on_rank(model_dir, 0, 2, enable_expert_parallel=True)


def test_unexpected_tensor_is_named_without_blaming_the_experts(moe_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = rewritten_checkpoint(moe_models["mixtral"], tmp_path / "stray",
                                     add="model.layers.0.block_sparse_moe.stray.weight")
    with pytest.raises(WeightLoadError, match=r"block_sparse_moe\.stray\.weight") as info:
        load_on_rank(model_dir, 0, 1)
    assert "w13_weight" not in str(info.value) and "not loaded" not in str(info.value)


def test_dummy_load_format_fills_the_experts(moe_models: dict[str, Path]) -> None:
    for rank, kwargs in ((0, {}), (1, {"enable_expert_parallel": True})):
        model = load_on_rank(moe_models["qwen3_moe"], rank, 2 if kwargs else 1, load_format="dummy", **kwargs)
        experts = model.model.layers[1].mlp.experts
        assert 0 < float(experts.w13_weight.abs().max()) <= 1e-3 and 0 < float(experts.w2_weight.abs().max()) <= 1e-3


def test_quantised_expert_format_is_refused(moe_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tmp_path / "quantised"
    model_dir.mkdir()
    for f in moe_models["mixtral"].iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    # GPTQ experts are served (tests/test_quant_wna16_moe.py), but not with act-order
    edit_config(model_dir, quantization_config={"quant_method": "gptq", "bits": 4, "desc_act": True})
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method='gptq'.*desc_act=True"):
        load_on_rank(model_dir, 0, 1)


# ---------------------------------------------------------------------- generation against transformers

# (checkpoint, tp, enable_expert_parallel)
ENGINES = [
    ("mixtral", 1, False),
    ("qwen3_moe", 1, False),
    ("qwen3_moe_step2", 1, False),
    ("mixtral", 2, False),
    ("mixtral", 2, True),
    ("qwen3_moe", 2, False),
    ("qwen3_moe", 2, True),
    ("qwen3_moe", 4, True),  # one expert per rank
]


@pytest.fixture(scope="module")
def hf_moe_reference(moe_models: dict[str, Path]) -> Any:
    """hf_moe_reference(name) -> per prompt of make_prompts: (greedy ids, their logprobs,
    the prompt's logprobs), cached."""
    cache: dict[str, list[tuple[list[int], torch.Tensor, torch.Tensor]]] = {}

    def get(name: str) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        if name not in cache:
            hf = _hf_model(moe_models[name])
            cache[name] = [(*hf_greedy(hf, p, MAX_NEW), hf_prompt_logprobs(hf, p))
                           for p in make_prompts(hf.config.vocab_size)]
        return cache[name]

    return get


@pytest.fixture(scope="module", params=ENGINES, ids=[f"{m}-tp{tp}{'-ep' if ep else ''}" for m, tp, ep in ENGINES])
def moe_engine(request: pytest.FixtureRequest, moe_models: dict[str, Path]) -> Any:
    name, tp, ep = request.param
    with EngineCore(engine_config(moe_models[name], tp, 16, enable_expert_parallel=ep)) as core:
        yield name, tp, ep, core


@pytest.mark.slow
def test_moe_engine_ranks_hold_their_share_of_experts(moe_engine: Any) -> None:
    name, tp, ep, core = moe_engine
    num_experts, inter = (4 if name != "qwen3_moe" else 8), 32
    per_rank = (num_experts // tp, 2 * inter, 64) if ep else (num_experts, 2 * inter // tp, 64)
    for rank_shapes in core.collective_rpc(expert_shapes_on_rank):
        assert rank_shapes and all(w13 == per_rank for w13, _ in rank_shapes)


@pytest.mark.slow
def test_moe_greedy_and_logprobs_match_transformers(moe_engine: Any, hf_moe_reference: Any) -> None:
    # test_generation's check on this engine: greedy ids equal, top-5 logprobs within its tolerance.
    name, _, _, core = moe_engine
    generation.test_logprobs_match_transformers(generation.Engine(name, core),
                                                lambda n: [ref[:2] for ref in hf_moe_reference(n)])


@pytest.mark.slow
def test_moe_prompt_logprobs_match_transformers(moe_engine: Any, hf_moe_reference: Any) -> None:
    name, _, _, core = moe_engine
    cases = [(p, ref[2]) for p, ref in zip(make_prompts(core.config.model_config.vocab_size), hf_moe_reference(name))
             if len(p) > 1]
    outs = core.generate([p for p, _ in cases], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))
    for (prompt, ref_prompt_lp), out in zip(cases, outs):
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert_logprobs_match(out.prompt_logprobs[1:], ref_prompt_lp, prompt[1:], 5, f"{name}: prompt of {len(prompt)}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_sliding_window_matches_transformers(family: str, tmp_path: Path) -> None:
    window = {"sliding_window": 12} if family == "mixtral" else {"sliding_window": 12, "use_sliding_window": True}
    model_dir = write_moe_checkpoint(tmp_path / family, family, seed=4, **window)
    hf = _hf_model(model_dir)
    prompts = make_prompts(320)  # up to 61 tokens: many windows
    with EngineCore(engine_config(model_dir, 1, 4)) as core:
        outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_NEW)[0], f"prompt of {len(prompt)} tokens"
