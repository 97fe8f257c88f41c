"""A decode step's experts in one C call (models/layers/fused_moe/cpu_moe.py): the
grouped torch kernel's result for bfloat16 and float16 (the same roundings, in the same
order; only the products' float32 summation order differs, and with it an
intermediate's 16-bit rounding now and then), under expert parallelism too, with the
products this CPU's build takes (AVX-512 BF16's register tile for bfloat16, AVX-512's
16-lane tiles for float16 and where that tile is missing, AVX2's dot products without
AVX-512) and with the other CPUs' built on purpose; results that do not depend on the
thread count; where it is taken; refusals; and in the engine, bfloat16 and float16 MoE
decode steps recorded as CPU graphs, replaying what the eager steps compute at TP 1 and
2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import SamplingParams
from distributed.native_build import load_kernel
from engine.core import EngineCore
from models.layers.cpu_bf16_gemm import cpu_has_avx512_bf16
from models.layers.cpu_sgemm import cpu_has_avx2, cpu_has_avx512
from models.layers.fused_moe import cpu_moe, fused_topk
from models.layers.fused_moe.grouped_moe import grouped_fused_experts
from tests.moe_checkpoints import write_moe_checkpoint

kernel = cpu_moe.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="neither AVX-512 BF16 nor AVX2 in this CPU, or no build")


def _case(num_experts: int, hidden: int, inter: int, tokens: int, top_k: int, seed: int,
          dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.05).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = fused_topk(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_experts,hidden,inter,tokens,top_k", [
    (8, 256, 96, 5, 2), (16, 512, 128, 33, 4), (4, 64, 32, 1, 1), (8, 96, 40, 64, 8), (6, 130, 18, 3, 2),
    (16, 1024, 96, 1, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_grouped_kernels_result(num_experts, hidden, inter, tokens, top_k, dtype):
    """Rows, intermediate sizes and token counts off the 4 x 4 register tile and the dot
    products' 24-row blocks included, bfloat16 and float16 experts. Each output is a
    16-bit sum of top_k 16-bit terms: it may differ from the torch kernel's by a half ulp
    per addition and an ulp or two from the terms themselves, so within (top_k + 2) half
    ulps (2^-8 in bfloat16, 2^-11 in float16) of its row's largest value."""
    x, w13, w2, weights, ids = _case(num_experts, hidden, inter, tokens, top_k, tokens, dtype)
    expected = grouped_fused_experts(x, w13, w2, weights, ids).float()
    got = kernel.experts(x, w13, w2, weights, ids, None, num_experts)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    scale = expected.abs().amax(-1, keepdim=True)
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert ((got.float() - expected).abs() <= (top_k + 2) * half_ulp * scale + 1e-6).all()


def test_the_build_takes_the_cpus_products():
    assert kernel.products == ("bf16_tile" if cpu_has_avx512_bf16() else "half_tile" if cpu_has_avx512() else "avx2")


@pytest.mark.parametrize("flag,products", [("-mno-avx512f", "avx2"), ("-mno-avx512bf16", "half_tile")],
                         ids=["avx2", "avx512f_without_bf16"])
def test_the_other_cpus_products_built_on_purpose(flag, products, tmp_path, monkeypatch):
    """The same source built without AVX-512 (what an AVX2 CPU builds: 8-lane dot
    products) and without AVX-512 BF16 (Skylake-X to Ice Lake: bfloat16 experts in the
    16-lane widened tiles, as float16 ones everywhere with AVX-512) gives the grouped
    kernel's result too, under expert parallelism as well, wherever this CPU runs that
    build."""
    if not (cpu_has_avx2() if products == "avx2" else cpu_has_avx512()):
        pytest.skip(f"this CPU cannot run the {products} build")
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    built = load_kernel(cpu_moe.SOURCES, cpu_moe.COMPILE_FLAGS + (flag,), cpu_moe.LINK_FLAGS,
                        cpu_moe.LINK_LIBS, cpu_moe.CpuMoeKernel, "no build: %s")
    assert built is not None and built.products == products
    for num_experts, hidden, inter, tokens, top_k in [(8, 256, 96, 5, 2), (16, 512, 128, 33, 4), (6, 130, 18, 3, 2)]:
        for dtype, half_ulp in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
            x, w13, w2, weights, ids = _case(num_experts, hidden, inter, tokens, top_k, tokens, dtype)
            expected = grouped_fused_experts(x, w13, w2, weights, ids).float()
            got = built.experts(x, w13, w2, weights, ids, None, num_experts).float()
            scale = expected.abs().amax(-1, keepdim=True)
            assert ((got - expected).abs() <= (top_k + 2) * half_ulp * scale + 1e-6).all(), dtype
    x, w13, w2, weights, ids = _case(8, 128, 64, 9, 2, 3)
    expert_map = torch.full((8,), -1, dtype=torch.int64)
    expert_map[4:] = torch.arange(4)
    local13, local2 = w13[4:].contiguous(), w2[4:].contiguous()
    expected = grouped_fused_experts(x, local13, local2, weights, ids, expert_map).float()
    got = built.experts(x, local13, local2, weights, ids, expert_map, 8).float()
    assert ((got - expected).abs() <= 4 * 2.0 ** -8 * expected.abs().amax(-1, keepdim=True) + 1e-6).all()


def test_the_result_does_not_depend_on_the_thread_count():
    """The active experts' row blocks are split between threads by work (each expert's
    tokens), and a thread done with its share takes blocks from the end of another's:
    each output is one thread's sum in a fixed order, so 1, 2 and 3 threads give the same
    bits, for one token (4 of 16 experts: one row at a time) and for batches whose
    experts get different counts."""
    threads = torch.get_num_threads()
    try:
        for tokens, dtype in ((1, torch.bfloat16), (6, torch.bfloat16), (40, torch.bfloat16), (1, torch.float16),
                              (40, torch.float16)):
            x, w13, w2, weights, ids = _case(16, 256, 96, tokens, 4, 40 + tokens, dtype)
            results = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append(kernel.experts(x, w13, w2, weights, ids, None, 16))
            assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2]), (tokens, dtype)
    finally:
        torch.set_num_threads(threads)


_WITHHELD_THREADS = """
import torch
from models.layers.fused_moe import cpu_moe
from tests.test_cpu_moe import _case
for dtype in (torch.float16, torch.bfloat16):
    x, w13, w2, weights, ids = _case(16, 256, 96, 40, 4, 7, dtype)
    torch.set_num_threads(3)
    asked_three = cpu_moe.load().experts(x, w13, w2, weights, ids, None, 16)  # first: fresh scratch
    torch.set_num_threads(1)
    assert torch.equal(asked_three, cpu_moe.load().experts(x, w13, w2, weights, ids, None, 16)), dtype
"""


def test_blocks_of_a_thread_openmp_does_not_start_are_taken_by_the_others():
    """Asked for 3 threads where OpenMP starts 1 (OMP_THREAD_LIMIT=1), the one thread
    computes its own share and then the two others' blocks: the same bits as 1 thread
    asked for (a kernel that left the others' shares alone fails this)."""
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _WITHHELD_THREADS], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_only_this_ranks_experts_under_expert_parallelism():
    """With an expert map (rank 1 of 2: experts 4-7), the partial sum of the local
    experts, as the torch kernel gives it; a token none of whose experts is here is 0."""
    x, w13, w2, weights, ids = _case(8, 128, 64, 9, 2, 3)
    ids[0] = torch.tensor([0, 1])  # both elsewhere
    expert_map = torch.full((8,), -1, dtype=torch.int64)
    expert_map[4:] = torch.arange(4)
    local13, local2 = w13[4:].contiguous(), w2[4:].contiguous()
    expected = grouped_fused_experts(x, local13, local2, weights, ids, expert_map).float()
    got = kernel.experts(x, local13, local2, weights, ids, expert_map, 8).float()
    assert torch.equal(got[0], torch.zeros(128))
    assert ((got - expected).abs() <= 4 * 2.0 ** -8 * expected.abs().amax(-1, keepdim=True) + 1e-6).all()


def test_where_it_is_taken_and_refusals():
    x, w13, w2, weights, ids = _case(4, 64, 32, cpu_moe.MAX_TOKENS + 1, 2, 5)
    assert cpu_moe.serves(x[:cpu_moe.MAX_TOKENS], w13, w2) is kernel
    assert cpu_moe.serves(x, w13, w2) is None  # a prefill's batch: the grouped GEMMs
    assert cpu_moe.serves(x[:4].half(), w13.half(), w2.half()) is kernel
    assert cpu_moe.serves(x[:4].float(), w13.float(), w2.float()) is None
    assert cpu_moe.serves(x[:4].half(), w13, w2) is None  # dtypes that differ
    assert cpu_moe.serves(x[:0], w13, w2) is None
    ids[0, 0] = 4
    with pytest.raises(ValueError, match="outside the model's 4 experts"):
        kernel.experts(x[:2], w13, w2, weights[:2], ids[:2], None, 4)


# ------------------------------------------------------------------ the engine


def _captured_sizes(worker) -> list[int]:
    graphs = worker.model_runner.cpu_graphs
    return [] if graphs is None else graphs.captured_sizes


def _decode(model: Path, eager: bool, tp: int, dtype: str = "bfloat16") -> tuple[list, list[list[int]]]:
    prompts = [[5, 9, 13, 2, 7, 11, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42, 17]]
    with EngineCore(model=str(model), device="cpu", dtype=dtype, max_model_len=128, kv_cache_memory_bytes=1 << 22,
                    block_size=16, tensor_parallel_size=tp, enforce_eager=eager, use_tqdm_on_load=False) as core:
        outs = core.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
                                       for n in (12, 6, 9)])
        sizes = core.collective_rpc(_captured_sizes)
    return [(o.token_ids, o.logprobs) for o in outs], sizes


@pytest.mark.parametrize("tp,dtype", [(1, "bfloat16"), (1, "float16"), pytest.param(2, "bfloat16",
                                                                                    marks=pytest.mark.slow)])
def test_moe_decode_steps_are_recorded_and_replay_eager(tp, dtype, tmp_path):
    """A Qwen3-MoE (8 experts, a dense first layer) in bfloat16 and in float16: every
    decode batch size is recorded (the experts no longer read their counts on the host)
    and replays the eager steps' tokens and logprobs."""
    model = write_moe_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", seed=2, num_experts=8, mlp_only_layers=[0])
    eager, none = _decode(model, True, tp, dtype)
    replayed, sizes = _decode(model, False, tp, dtype)
    assert none == [[]] * tp and sizes == [[1, 2, 3]] * tp
    assert replayed == eager
