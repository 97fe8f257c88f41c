"""A per-layer contiguous copy of the decoding sequences' keys and values (CPU path).

Attending a decode step over the paged cache means gathering every sequence's blocks
into one padded batch, in every layer, every step: on the CPU that copy costs about as
much as the attention itself. Between two consecutive decode steps of the same batch,
though, each sequence gains exactly one token. `DecodeContext` keeps the last gathered
batch and, when the next step is that continuation, writes just the new token into it.
Any other step (a sequence joined, left, was preempted, or the batch grew past the
buffer) gathers afresh from the paged cache, which stays the only source of truth.

Owned by one layer's `CPUAttentionImpl` (backends/cpu_attn.py), used on every rank,
for a CPU cache only (on CUDA the gather is cheap next to the rest of the step, and
device memory is the KV cache's). A layer holds at most `max_bytes`, which the CPU
backend sets to an equal share of `TOTAL_BYTES`; a batch that needs more is gathered
per step instead. That memory is outside the KV-cache budget, like any activation.
"""

from __future__ import annotations

from typing import Protocol

import torch

from distributed.utils import cdiv
from models.layers.attention.backends.abstract import gather_paged_kv

# All layers' buffers together stay under this (the backend divides it among the layers).
TOTAL_BYTES = 256 << 20
# Spare positions per sequence, so that a batch decodes this many steps between gathers.
_GROWTH = 64


class DecodeBatch(Protocol):
    """What `DecodeContext.get` reads of a step's metadata: the CPU backend's
    `CPUAttentionMetadata` (backends/cpu_attn.py, which imports this module)."""

    @property
    def decode_keys(self) -> tuple[int, ...] | None: ...  # one key per decode sequence

    @property
    def decode_lens(self) -> tuple[int, ...]: ...  # their context lengths after this step

    @property
    def decode_gather_blocks(self) -> tuple[torch.Tensor, int]: ...

    def decode_suffix_gather(self, prefix_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, torch.Tensor]: ...

    def decode_append_index(self, capacity: int, start: int = 0) -> torch.Tensor: ...


class DecodeContext:
    def __init__(self, max_bytes: int = TOTAL_BYTES, build_on_repeat: bool = False) -> None:
        """`build_on_repeat`: make a new buffer only for a batch that already ran the
        step before (until then `get` returns None and the caller gathers), for a
        caller whose batches often change every step (a server's cascade decode), where
        building a buffer each step would cost more than the gathers it replaces."""
        self.max_bytes = max_bytes
        self.build_on_repeat = build_on_repeat
        self.seen: tuple[int, ...] = ()  # the keys of the last step asked about
        self.buffer: torch.Tensor | None = None  # [2, kv_heads, num_seqs, capacity, head_size]
        self.keys: tuple[int, ...] = ()
        self.lens: tuple[int, ...] = ()  # each row's valid length (from `start` on)
        self.start = 0

    def get(
        self, cache: torch.Tensor, md: DecodeBatch, k: torch.Tensor, v: torch.Tensor, start: int = 0
    ) -> torch.Tensor | None:
        """The decode sequences' context from position `start` on ([2, kv_heads, G,
        >= max len - start, head_size], rows in `md.decode_seqs` order, valid up to each
        sequence's length - start) after this step's `k`, `v` ([G, kv_heads, head_size],
        already written to the paged `cache`), or None when the step carries no sequence
        keys, the cache is not on the CPU, the batch would not fit, or (`build_on_repeat`)
        it is new since the last step. `start` is 0 for the whole context, or the length
        of a prefix every sequence shares (a multiple of the block size: the cascade
        keeps only what follows it)."""
        keys = md.decode_keys
        if keys is None or cache.device.type != "cpu":
            return None
        repeated, self.seen = keys == self.seen, keys
        lens = tuple(n - start for n in md.decode_lens)
        num_kv_heads, head_size = cache.shape[3], cache.shape[4]
        buffer = self.buffer
        if (
            buffer is not None
            and keys == self.keys
            and start == self.start
            and tuple(n - 1 for n in lens) == self.lens
            and max(lens) <= buffer.shape[3]
        ):
            # One index_copy_ over [2 * Hkv, G * capacity, D] writes both K and V.
            flat = buffer.view(2 * num_kv_heads, -1, head_size)
            new = torch.stack((k, v)).to(buffer.dtype).permute(0, 2, 1, 3).reshape(2 * num_kv_heads, -1, head_size)
            flat.index_copy_(1, md.decode_append_index(buffer.shape[3], start), new)
            self.lens = lens
            return buffer
        if self.build_on_repeat and not repeated:
            self.release()
            return None
        blocks, ctx_len = md.decode_gather_blocks if start == 0 else md.decode_suffix_gather(start, k.dtype)[:2]
        capacity = cdiv(ctx_len, _GROWTH) * _GROWTH + _GROWTH
        nbytes = 2 * num_kv_heads * len(keys) * capacity * head_size * cache.element_size()
        if nbytes > self.max_bytes:
            self.release()
            return None
        if buffer is None or tuple(buffer.shape) != (2, num_kv_heads, len(keys), capacity, head_size):
            # Zeros, not empty: positions past a row's length are masked with -inf, which
            # would not hide a NaN left in uninitialised memory.
            buffer = torch.zeros(2, num_kv_heads, len(keys), capacity, head_size, dtype=cache.dtype, device=cache.device)
        buffer[:, :, :, :ctx_len].copy_(gather_paged_kv(cache, blocks, len(keys), ctx_len))
        self.buffer, self.keys, self.lens, self.start = buffer, keys, lens, start
        return buffer

    def release(self) -> None:
        self.buffer, self.keys, self.lens, self.start = None, (), (), 0
