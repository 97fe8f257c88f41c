"""Cascade decode attention in the CPU backend (models/layers/attention/backends/cpu_attn.py).

When a decode batch is too large for the per-layer decode context and its sequences
share leading KV blocks (the prefix cache gives one system prompt's blocks to every
request), the CPU backend attends the shared prefix once for the whole batch and each
sequence's own tokens separately, merged by log-sum-exp. Its output must equal the SDPA
backend's plain grouped gather over the same paged cache.
"""

from __future__ import annotations

import pytest
import torch

from models.layers.attention import Attention, AttentionMetadata
from models.layers.attention.backends.cpu_attn import CASCADE_MIN_TOKENS, CPUAttentionBackend, CPUAttentionMetadata
from models.layers.attention.backends.torch_sdpa import TorchSDPABackend

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 16, 16


def decode_step(shared_blocks: int, own_lens: list[int], dtype: torch.dtype,
                paged_decode: bool = True) -> tuple[torch.Tensor, ...]:
    """Outputs of the CPU backend (with the paged decode kernel, or on its torch path)
    and of the SDPA backend for one decode step of len(own_lens) sequences that share
    `shared_blocks` leading blocks."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 512
    cache = torch.randn(num_blocks, 2, BLOCK, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    shared = list(range(shared_blocks))
    next_block = shared_blocks
    tables, lens = [], []
    for own in own_lens:
        count = -(-own // BLOCK)
        tables.append(shared + list(range(next_block, next_block + count)))
        next_block += count
        lens.append(shared_blocks * BLOCK + own)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long)
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)])
    common = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, seq_lens=lens,
                               query_start_loc=list(range(len(lens) + 1)), block_size=BLOCK,
                               req_ids=tuple(f"r{i}" for i in range(len(lens))))
    q = torch.randn(len(lens), HEADS, HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(len(lens), KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(len(lens), KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    outs = []
    # A decode-context budget of 0 bytes: the batch never fits, so the cascade path runs.
    cpu = CPUAttentionBackend(num_layers=1, decode_context_bytes=0, paged_decode=paged_decode)
    assert (cpu.kernel is not None) == paged_decode
    for backend in (cpu, TorchSDPABackend()):
        layer = Attention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
        layer.bind_kv_cache(cache.clone(), backend.make_impl(layer))
        md = backend.build_metadata(common)
        outs.append(layer.impl.forward(q.clone(), k.clone(), v.clone(), layer.kv_cache, md))
    return outs[0], outs[1], backend_md(common)


def backend_md(common: AttentionMetadata) -> CPUAttentionMetadata:
    return CPUAttentionBackend(num_layers=1).build_metadata(common)  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.parametrize("paged_decode", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_cascade_equals_the_plain_gather(dtype: torch.dtype, atol: float, paged_decode: bool) -> None:
    own = [1, 5, 16, 17, 40, 3, 33, 2, 9, 64]
    cascade, plain, md = decode_step(shared_blocks=8, own_lens=own, dtype=dtype, paged_decode=paged_decode)
    assert md.decode_shared_prefix is not None and md.decode_shared_prefix[1] == 8 * BLOCK
    torch.testing.assert_close(cascade.float(), plain.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("paged_decode", [True, False], ids=["kernel", "torch"])
def test_no_cascade_without_a_long_enough_shared_prefix(paged_decode: bool) -> None:
    short = CASCADE_MIN_TOKENS // BLOCK - 1
    _, _, md = decode_step(shared_blocks=short, own_lens=[3, 4, 5], dtype=torch.float32, paged_decode=paged_decode)
    assert md.decode_shared_prefix is None
    cascade, plain, md = decode_step(shared_blocks=0, own_lens=[200, 100], dtype=torch.float32,
                                     paged_decode=paged_decode)
    assert md.decode_shared_prefix is None
    torch.testing.assert_close(cascade, plain, atol=2e-5, rtol=0)


def test_cascade_keeps_the_suffix_across_steps_and_still_equals_the_plain_gather() -> None:
    """On the torch path (no kernel): several decode steps of one batch whose whole
    context is too large for the decode context but whose own tokens fit: the suffix context is gathered once, then extended
    by one token per step (the same buffer), and every step's output equals the plain
    gather's. A batch that changes is gathered afresh."""
    gen = torch.Generator().manual_seed(1)
    shared_blocks, own_lens, steps = 32, [3, 17, 30, 9, 1, 24], 40
    cache = torch.randn(1024, 2, BLOCK, KV_HEADS, HEAD_SIZE, generator=gen)
    shared = list(range(shared_blocks))
    free = list(range(1023, shared_blocks - 1, -1))
    tables = [shared + [free.pop() for _ in range(-(-own // BLOCK))] for own in own_lens]
    lens = [shared_blocks * BLOCK + own for own in own_lens]
    # Room for ~300 positions per row: the whole context (512 + own) never fits, the suffix does.
    budget = 2 * KV_HEADS * len(lens) * 300 * HEAD_SIZE * cache.element_size()
    cpu = CPUAttentionBackend(num_layers=1, decode_context_bytes=budget, paged_decode=False)
    sdpa = TorchSDPABackend()
    layers = []
    for backend in (cpu, sdpa):
        layer = Attention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
        layer.bind_kv_cache(cache, backend.make_impl(layer))
        layers.append(layer)
    impl = layers[0].impl
    buffers = []
    for step in range(steps):
        if step == steps // 2:  # a sequence leaves: the batch changes, the suffix is gathered afresh
            tables, lens = tables[1:], lens[1:]
            cpu.requests_finished(["r0"])
        names = tuple(f"r{i + (len(own_lens) - len(lens))}" for i in range(len(lens)))
        for i, table in enumerate(tables):
            lens[i] += 1
            if len(table) * BLOCK < lens[i]:
                table.append(free.pop())
        width = max(map(len, tables))
        block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long)
        slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)])
        common = AttentionMetadata(slot_mapping=slots, block_tables=block_tables, seq_lens=list(lens),
                                   query_start_loc=list(range(len(lens) + 1)), block_size=BLOCK, req_ids=names)
        q = torch.randn(len(lens), HEADS, HEAD_SIZE, generator=gen)
        k = torch.randn(len(lens), KV_HEADS, HEAD_SIZE, generator=gen)
        v = torch.randn(len(lens), KV_HEADS, HEAD_SIZE, generator=gen)
        # The first layer writes this step's K/V into the shared cache; the second rewrites the same values.
        outs = [layer.impl.forward(q.clone(), k.clone(), v.clone(), layer.kv_cache, backend.build_metadata(common))
                for layer, backend in zip(layers, (cpu, sdpa))]
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)
        assert impl.decode_context.buffer is None  # the whole context never fit
        assert impl.suffix_context.buffer is None or impl.suffix_context.start == shared_blocks * BLOCK
        buffers.append(impl.suffix_context.buffer)
    first_half, second_half = buffers[: steps // 2], buffers[steps // 2:]
    # A batch's first step gathers; the buffer is made at its second and then extended
    # in place (its capacity is not passed within these steps).
    assert first_half[0] is None and first_half[1] is not None
    assert all(b is first_half[1] for b in first_half[1:20])
    assert second_half[0] is None and second_half[1] is not None and second_half[1] is not first_half[1]
    assert all(b is second_half[1] for b in second_half[1:10])
