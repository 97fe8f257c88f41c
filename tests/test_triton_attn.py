"""The Triton paged-attention backend, TRITON_ATTN (models/layers/attention/backends/triton_attn.py).

One kernel launch attends every sequence of a step: decode tokens, whole prompts, chunks
that continue a cached context (chunked prefill, prefix-cache hits), reading K/V through
the block table. Its output must equal attention computed the long way (each sequence's
keys gathered by hand, float64 masked softmax), and the cache must hold exactly the
step's new K/V at their slots afterwards, for every layout the runner produces: GQA and
MQA, head sizes that are not powers of two, block sizes that are not either, shuffled
physical blocks, float32/float16/bfloat16, sliding windows, padding rows. The engine
with TRITON_ATTN must generate transformers' greedy tokens at TP 1 and 2.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1); on a GPU machine the same kernel tests run compiled on CUDA, and
the `cuda` tests add CUDA graph capture and replay.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from config import ConfigError, SamplingParams
from engine.arg_utils import create_engine_config
from engine.core import EngineCore
from models.layers.attention import Attention, AttentionMetadata, get_attn_backend
from models.layers.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionMetadata
from models.layers.attention.ops import triton_unified_attention
from tests.test_generation import _hf_model, hf_greedy

# The kernel tests run where the kernels run: compiled on a GPU, interpreted on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="TRITON_ATTN on the CPU runs under Triton's interpreter only")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Step(NamedTuple):
    seqs: list[tuple[int, int]]  # (seq_len, query_len); seq_len 0 = a padding row
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    cache: torch.Tensor  # before the step: random K/V in every slot
    block_tables: torch.Tensor  # [num_seqs, max_blocks], -1 past each sequence's blocks
    common: AttentionMetadata


def paged_step(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               dtype: torch.dtype = torch.float32, seed: int = 0, device: str = DEVICE,
               num_blocks: int | None = None) -> Step:
    """One step of `seqs` over a cache whose blocks are handed out in shuffled order
    (three spare blocks never used, unless `num_blocks` says how many there are). A
    padding row (seq_len 0) has one query token with slot -1 and no blocks, or no query
    token at all (query_len 0)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n, _ in seqs]
    order = torch.randperm(num_blocks or sum(counts) + 3, generator=gen).tolist()
    cache = torch.randn(len(order), 2, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    tables, slots, qsl = [], [], [0]
    for (seq_len, query_len), count in zip(seqs, counts):
        table = [order.pop() for _ in range(count)]
        tables.append(table)
        if seq_len == 0:
            slots += [-1] * query_len
        else:
            slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)]
        qsl.append(qsl[-1] + query_len)
    width = max(counts) + 1
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long)
    tokens = qsl[-1]
    q = torch.randn(tokens, num_heads, head_size, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    common = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device), block_tables=block_tables.to(device),
                               seq_lens=[n for n, _ in seqs], query_start_loc=qsl, block_size=block_size)
    return Step(seqs, q.to(device), k.to(device), v.to(device), cache.to(device), block_tables, common)


def reference(step: Step, scale: float, sliding_window: int | None = None,
              soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D] float64, the cache after the step): each sequence's keys gathered
    position by position from the cache before the step, its chunk's from k and v."""
    cache = step.cache.cpu()
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    q, k, v = step.q.cpu().double(), step.k.cpu().double(), step.v.cpu().double()
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    after = cache.clone()
    qsl = step.common.query_start_loc
    for i, (seq_len, query_len) in enumerate(step.seqs):
        start, end = qsl[i], qsl[i + 1]
        if seq_len == 0:
            continue
        context_len = seq_len - query_len
        pos = torch.arange(seq_len)
        blocks, offsets = step.block_tables[i, pos // block_size], pos % block_size
        keys, values = cache[blocks, 0, offsets].double(), cache[blocks, 1, offsets].double()
        keys[context_len:], values[context_len:] = k[start:end], v[start:end]
        after[blocks[context_len:], 0, offsets[context_len:]] = step.k[start:end].cpu().to(cache.dtype)
        after[blocks[context_len:], 1, offsets[context_len:]] = step.v[start:end].cpu().to(cache.dtype)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys.repeat_interleave(group, 1)) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = (context_len + torch.arange(query_len)).unsqueeze(1)
        visible = pos.unsqueeze(0) <= q_pos
        if sliding_window:
            visible &= pos.unsqueeze(0) > q_pos - sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(group, 1))
    return out, after


def run_backend(step: Step, sliding_window: int | None = None, soft_cap: float | None = None,
                md: TritonAttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, cache after the step) through an Attention layer bound to TRITON_ATTN."""
    num_heads, num_kv_heads, head_size = step.q.shape[1], step.k.shape[1], step.q.shape[2]
    layer = Attention(num_heads, head_size, head_size**-0.5, num_kv_heads, sliding_window=sliding_window)
    layer.logits_soft_cap = soft_cap
    backend = TritonAttentionBackend()
    cache = step.cache.clone()
    layer.bind_kv_cache(cache, backend.make_impl(layer))
    md = backend.build_metadata(step.common) if md is None else md
    out = layer.impl.forward(step.q.clone(), step.k.clone(), step.v.clone(), cache, md)
    return out, cache


def check(step: Step, sliding_window: int | None = None, soft_cap: float | None = None) -> None:
    out, cache = run_backend(step, sliding_window, soft_cap)
    expected, expected_cache = reference(step, step.q.shape[2] ** -0.5, sliding_window, soft_cap)
    assert out.dtype == step.q.dtype and out.shape == step.q.shape
    torch.testing.assert_close(out.cpu().double(), expected, atol=ATOL[step.q.dtype], rtol=0)
    assert torch.equal(cache.cpu(), expected_cache)  # the new K/V at their slots, nothing else


# (num_heads, num_kv_heads, head_size, block_size)
LAYOUTS = {
    "gqa4-d64-bs16": (8, 2, 64, 16),
    "mqa-d32-bs12": (4, 1, 32, 12),
    "gqa3-d80-bs24": (6, 2, 80, 24),
    "mha-d16-bs16": (2, 2, 16, 16),
}
DECODE = [(1, 1), (15, 1), (16, 1), (17, 1), (70, 1)]  # block edges, one token, a long context
PREFILL = [(37, 37), (5, 5), (64, 64)]  # whole prompts
CHUNKED = [(40, 16), (70, 30), (25, 24)]  # chunks after cached context (prefix hits, earlier chunks)
MIXED = [(33, 1), (50, 20), (9, 9), (70, 1), (26, 13)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_decode_batch_matches_the_reference(layout: str) -> None:
    check(paged_step(DECODE, *LAYOUTS[layout]))


@pytest.mark.parametrize("layout", ["gqa4-d64-bs16", "gqa3-d80-bs24"])
def test_whole_prompt_prefill_matches_the_reference(layout: str) -> None:
    check(paged_step(PREFILL, *LAYOUTS[layout]))


@pytest.mark.parametrize("layout", ["gqa4-d64-bs16", "mqa-d32-bs12"])
def test_chunked_prefill_over_cached_context_matches_the_reference(layout: str) -> None:
    check(paged_step(CHUNKED, *LAYOUTS[layout]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["gqa4-d64-bs16", "mqa-d32-bs12", "gqa3-d80-bs24"])
def test_mixed_batch_matches_the_reference_in_every_dtype(layout: str, dtype: torch.dtype) -> None:
    check(paged_step(MIXED, *LAYOUTS[layout], dtype=dtype, seed=1))


def test_q_k_v_as_views_of_one_fused_qkv_projection() -> None:
    # What Attention.forward passes: strided views, not contiguous tensors.
    step = paged_step(MIXED, *LAYOUTS["gqa3-d80-bs24"], seed=5)
    qkv = torch.cat([step.q, step.k, step.v], dim=1)
    heads, kv_heads = step.q.shape[1], step.k.shape[1]
    views = step._replace(q=qkv[:, :heads], k=qkv[:, heads:heads + kv_heads], v=qkv[:, heads + kv_heads:])
    assert not views.q.is_contiguous() and not views.k.is_contiguous()
    out, cache = run_backend(views)
    expected, expected_cache = run_backend(step)
    assert torch.equal(out, expected) and torch.equal(cache, expected_cache)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_in_decode_and_prefill(window: int) -> None:
    # Windows shorter than a chunk, than a block, and spanning block edges (bs 12).
    check(paged_step(MIXED + PREFILL[:1], *LAYOUTS["mqa-d32-bs12"], seed=2), sliding_window=window)


def test_logits_soft_cap() -> None:
    step = paged_step(MIXED, *LAYOUTS["gqa4-d64-bs16"], seed=3)
    step = step._replace(q=step.q * 4)  # scores well past the cap
    check(step, soft_cap=5.0)


def test_padding_rows_write_nothing_and_leave_the_other_rows_unchanged() -> None:
    # Rows of a batch padded to a CUDA graph's size: seq_len 0 with one query token whose
    # slot is -1, or with no query token at all.
    padded = paged_step(DECODE + [(0, 1), (0, 0), (0, 1)], *LAYOUTS["gqa4-d64-bs16"])
    plain = paged_step(DECODE, *LAYOUTS["gqa4-d64-bs16"])
    real = len(DECODE)
    # The same blocks and cache (the same draws); the real rows' q, k, v made equal.
    assert torch.equal(padded.cache, plain.cache) and torch.equal(padded.block_tables[:real], plain.block_tables)
    padded = padded._replace(**{name: torch.cat([getattr(plain, name), getattr(padded, name)[real:]])
                                for name in ("q", "k", "v")})
    out, cache = run_backend(padded)
    plain_out, plain_cache = run_backend(plain)
    assert torch.equal(out[:real], plain_out)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))  # no NaN to leak anywhere
    assert torch.equal(cache, plain_cache)


def test_metadata_from_device_tensors_equals_the_runners_and_holds_no_host_lists() -> None:
    step = paged_step(MIXED, *LAYOUTS["gqa4-d64-bs16"])
    built = TritonAttentionBackend().build_metadata(step.common)
    md = TritonAttentionMetadata.from_device_tensors(
        step.common.slot_mapping, step.common.block_tables,
        torch.tensor(step.common.seq_lens, device=DEVICE),
        torch.tensor(step.common.query_start_loc, device=DEVICE), block_size=16, max_query_len=20)
    assert (built.num_seqs, built.max_query_len) == (md.num_seqs, md.max_query_len) == (5, 20)
    for md_ in (built, md):
        for tensor in (md_.seq_lens, md_.query_start_loc, md_.block_tables, md_.slot_mapping):
            assert isinstance(tensor, torch.Tensor) and tensor.device.type == DEVICE
    assert torch.equal(run_backend(step, md=md)[0], run_backend(step, md=built)[0])
    decode = paged_step(DECODE, *LAYOUTS["gqa4-d64-bs16"])
    md = TritonAttentionBackend().make_decode_metadata(
        decode.common.slot_mapping, decode.common.block_tables.int(),
        torch.tensor(decode.common.seq_lens, dtype=torch.int32, device=DEVICE),
        torch.arange(len(DECODE) + 1, dtype=torch.int32, device=DEVICE), block_size=16)
    assert (md.num_seqs, md.max_query_len) == (len(DECODE), 1)
    assert torch.equal(run_backend(decode, md=md)[0], run_backend(decode)[0])
    with pytest.raises(ValueError, match="do not match"):
        TritonAttentionMetadata.from_device_tensors(md.slot_mapping, md.block_tables[:2], md.seq_lens,
                                                    md.query_start_loc, 16, 20)


def test_decode_grid_depends_only_on_the_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    grids: list[tuple[int, ...]] = []
    kernel = triton_unified_attention._unified_attention_kernel

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_unified_attention, "_unified_attention_kernel", Recorder())
    for seqs in ([(1, 1), (2, 1), (3, 1)], [(70, 1), (17, 1), (40, 1)]):
        check(paged_step(seqs, *LAYOUTS["gqa4-d64-bs16"]))
    assert grids[0] == grids[1] == (3, 2)  # (num_seqs, num_kv_heads)


def test_backend_is_chosen_by_name_and_an_unknown_name_lists_the_valid_ones() -> None:
    backend = get_attn_backend("TRITON_ATTN", num_layers=2)
    assert isinstance(backend, TritonAttentionBackend)
    assert backend.supports_cuda_graphs
    with pytest.raises(ValueError, match="TRITON_ATTN.*TORCH_SDPA.*CPU_ATTN"):
        get_attn_backend("FLASH_ATTN", num_layers=2)


# ------------------------------------------------------------------ configuration


def test_triton_attn_on_the_cpu_without_the_interpreter_is_a_config_error(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_ATTN.*TRITON_INTERPRET=1"):
        create_engine_config(model=str(tiny_models["llama"]), device="cpu", attention_backend="TRITON_ATTN")


def test_an_unknown_attention_backend_is_a_config_error_listing_the_valid_ones(
        tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="attention_backend='FLASH_ATTN'.*'TRITON_ATTN', 'TORCH_SDPA', 'CPU_ATTN'"):
        create_engine_config(model=str(tiny_models["llama"]), device="cpu", attention_backend="FLASH_ATTN")


# ------------------------------------------------------------------ end to end

MAX_NEW = 6
BLOCK = 12  # not a power of two


def generate_all(model_dir: Path, tp: int, attention_backend: str | None) -> tuple[list[list[int]], int]:
    """Greedy tokens of: a prompt prefilled in chunks of 16; a second prompt sharing
    its first two blocks (a prefix-cache hit, then chunks); both of those again in one
    batch. Returns the tokens and the prefix-cache hits."""
    config = create_engine_config(
        model=str(model_dir), tensor_parallel_size=tp, device="cpu", dtype="float32", max_model_len=128,
        max_num_seqs=4, max_num_batched_tokens=16, block_size=BLOCK, num_gpu_blocks_override=64,
        attention_backend=attention_backend)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    with EngineCore(config) as core:
        assert core.config.attention_config.backend == (attention_backend or "CPU_ATTN")
        tokens = [core.generate(p, params)[0].token_ids for p in prompts]
        tokens += [o.token_ids for o in core.generate(prompts, params)]
        return tokens, core.scheduler.block_manager.stats.hits


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(4, 320, (41,), generator=gen).tolist()
    return [first, first[: 2 * BLOCK + 3] + torch.randint(4, 320, (10,), generator=gen).tolist()]


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_with_triton_attn_generates_transformers_greedy_tokens(tp: int, tiny_models: dict[str, Path]) -> None:
    ours, hits = generate_all(tiny_models["llama"], tp, "TRITON_ATTN")
    assert hits >= 2 * BLOCK
    default, _ = generate_all(tiny_models["llama"], tp, None)
    assert ours == default
    hf = _hf_model(tiny_models["llama"])
    assert ours == [hf_greedy(hf, p, MAX_NEW)[0] for p in _prompts() * 2]


# ------------------------------------------------------------------ CUDA


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_cuda_kernel_matches_the_reference_without_a_host_sync(dtype: torch.dtype) -> None:
    for layout, window in (("gqa4-d64-bs16", None), ("gqa3-d80-bs24", 7), ("mqa-d32-bs12", None)):
        step = paged_step(MIXED + CHUNKED, *LAYOUTS[layout], dtype=dtype, seed=4, device="cuda")
        check(step, sliding_window=window)  # compiles the kernels
        md = TritonAttentionBackend().build_metadata(step.common)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_backend(step, window, md=md)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_graph_of_a_decode_batch_replays_with_new_lengths(dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_size, block_size = 32, 8, 128, 16
    first = paged_step([(5, 1), (17, 1), (0, 1), (0, 1)], num_heads, num_kv_heads, head_size, block_size, dtype,
                       device="cuda", num_blocks=40)
    later = paged_step([(300, 1), (64, 1), (129, 1), (0, 1)], num_heads, num_kv_heads, head_size, block_size,
                       dtype, seed=1, device="cuda", num_blocks=40)
    # Persistent buffers, sized for the larger step; the graph reads them in place.
    cache = torch.zeros_like(later.cache)
    q, k, v = (torch.zeros_like(t) for t in (later.q, later.k, later.v))
    slots = torch.zeros_like(later.common.slot_mapping)
    tables = torch.zeros(4, later.block_tables.shape[1], dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    qsl = torch.arange(5, dtype=torch.int32, device="cuda")
    layer = Attention(num_heads, head_size, head_size**-0.5, num_kv_heads)
    layer.bind_kv_cache(cache, TritonAttentionBackend().make_impl(layer))
    md = TritonAttentionBackend().make_decode_metadata(slots, tables, seq_lens, qsl, block_size)

    def load(step: Step) -> None:
        cache.copy_(step.cache)
        for dst, src in ((q, step.q), (k, step.k), (v, step.v), (slots, step.common.slot_mapping)):
            dst.copy_(src)
        tables.fill_(0)
        tables[:, : step.block_tables.shape[1]].copy_(step.block_tables.clamp(min=0))
        seq_lens.copy_(torch.tensor(step.common.seq_lens))

    load(first)
    layer.impl.forward(q, k, v, cache, md)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.impl.forward(q, k, v, cache, md)
    for step in (first, later):
        load(step)
        graph.replay()
        torch.cuda.synchronize()
        expected, expected_cache = reference(step, head_size**-0.5)
        torch.testing.assert_close(out.cpu().double(), expected, atol=ATOL[dtype], rtol=0)
        assert torch.equal(cache.cpu(), expected_cache)
