"""Prefill chunks through the paged decode kernel (models/layers/attention/backends/cpu_attn.py).

A step with prefill chunks is attended by the kernel in one call, every query token a
query of its own against the positions up to it. Its output must equal the SDPA
backend's (causal flash per whole prompt, a gathered context with a causal mask for a
chunk that continues a cached one), for whole prompts, continued chunks and decode
tokens in one step, on both of the kernel's paths (AVX-512 for head sizes 64 and 128
where the CPU has it, the portable one otherwise).
"""

from __future__ import annotations

import pytest
import torch

from models.layers.attention import Attention, AttentionMetadata
from models.layers.attention.backends import paged_decode
from models.layers.attention.backends import cpu_attn
from models.layers.attention.backends.cpu_attn import PREFILL_KERNEL_MAX_CONTEXT, CPUAttentionBackend
from models.layers.attention.backends.torch_sdpa import TorchSDPABackend

KERNEL = paged_decode.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler on this machine")
BLOCK = 16


def mixed_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_size: int, dtype: torch.dtype):
    """One step of `seqs` (seq_len, query_len) over a paged cache whose blocks are handed
    out in shuffled order; the positions before each chunk hold random cached K/V. Returns
    the cache, q, k, v and the common metadata."""
    gen = torch.Generator().manual_seed(0)
    counts = [-(-n // BLOCK) for n, _ in seqs]
    order = torch.randperm(sum(counts) + 4, generator=gen).tolist()
    cache = torch.randn(len(order), 2, BLOCK, kv_heads, head_size, generator=gen).to(dtype)
    tables, slots, qsl = [], [], [0]
    for (seq_len, query_len), count in zip(seqs, counts):
        table = [order.pop() for _ in range(count)]
        tables.append(table)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len - query_len, seq_len)]
        qsl.append(qsl[-1] + query_len)
    width = max(counts) + 1
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long)
    common = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=block_tables,
                               seq_lens=[n for n, _ in seqs], query_start_loc=qsl, block_size=BLOCK,
                               req_ids=tuple(f"r{i}" for i in range(len(seqs))))
    tokens = qsl[-1]
    q = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype)
    return cache, q, k, v, common


def attend(backend, cache, q, k, v, common, heads, kv_heads, head_size):
    layer = Attention(heads, head_size, head_size**-0.5, kv_heads)
    layer.bind_kv_cache(cache.clone(), backend.make_impl(layer))
    return layer.impl.forward(q.clone(), k.clone(), v.clone(), layer.kv_cache, backend.build_metadata(common))


class CountingKernel:
    """The loaded kernel, counting its calls and the query rows they carried."""

    def __init__(self, kernel: paged_decode.PagedDecodeKernel, avx512: bool | None = None) -> None:
        self.kernel, self.calls, self.rows = kernel, 0, []
        self.avx512 = kernel.avx512 if avx512 is None else avx512

    def supports(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return self.kernel.supports(q, kv_cache)

    def write_kv(self, *args) -> bool:
        return self.kernel.write_kv(*args)

    def __call__(self, q, *args, **kwargs):
        self.calls += 1
        self.rows.append(q.shape[0])
        return self.kernel(q, *args, **kwargs)


# (seq_len, query_len): whole prompts, chunks that continue a cached context, decode tokens
STEP = [(37, 37), (80, 30), (65, 1), (130, 130), (1, 1), (17, 16), (200, 8)]


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_size", [(12, 4, 64), (8, 2, 128), (8, 8, 16), (7, 1, 64)],
                         ids=["gqa3-d64", "gqa4-d128", "mha-d16", "gqa7-d64"])
def test_a_step_with_prefill_chunks_equals_the_sdpa_backend(heads, kv_heads, head_size, dtype, atol):
    cache, q, k, v, common = mixed_step(STEP, heads, kv_heads, head_size, dtype)
    cpu = CPUAttentionBackend(num_layers=1)
    counting = cpu.kernel = CountingKernel(cpu.kernel)
    ours = attend(cpu, cache, q, k, v, common, heads, kv_heads, head_size)
    theirs = attend(TorchSDPABackend(), cache, q, k, v, common, heads, kv_heads, head_size)
    assert counting.calls == 1 and counting.rows == [q.shape[0]]  # the whole step, one call
    torch.testing.assert_close(ours.float(), theirs.float(), atol=atol, rtol=0)


@needs_kernel
def test_contexts_past_the_measured_lengths_go_to_flash(monkeypatch):
    long = PREFILL_KERNEL_MAX_CONTEXT + 40
    # The AVX-512 path's limit lowered, so that a short test crosses it too.
    monkeypatch.setattr(cpu_attn, "PREFILL_KERNEL_MAX_CONTEXT_AVX512", long + 60)
    longer = long + 100
    for avx512, head_size, seqs, expect_kernel in [
        (False, 64, [(long, long), (3, 1)], False),           # portable path, a context past its limit
        (False, 64, [(PREFILL_KERNEL_MAX_CONTEXT, 64), (3, 1)], True),
        (True, 64, [(long, long), (3, 1)], True),             # the AVX-512 path goes further
        (True, 128, [(longer, 50), (3, 1)], False),           # ... up to its own limit
        (True, 80, [(long, long), (3, 1)], False),            # ... for head sizes 64 and 128 only
    ]:
        cache, q, k, v, common = mixed_step(seqs, 4, 2, head_size, torch.float32)
        cpu = CPUAttentionBackend(num_layers=1)
        counting = cpu.kernel = CountingKernel(cpu.kernel, avx512=avx512)
        ours = attend(cpu, cache, q, k, v, common, 4, 2, head_size)
        theirs = attend(TorchSDPABackend(), cache, q, k, v, common, 4, 2, head_size)
        took_all = counting.rows == [q.shape[0]]
        assert took_all == expect_kernel, (avx512, head_size, seqs, counting.rows)
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
