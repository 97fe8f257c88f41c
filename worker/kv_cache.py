"""KV cache sizing and allocation.

Each rank reports the `KVCacheSpec` of its model, derived from its attention layers (so
no other code computes heads per rank or the head size); the engine checks the ranks
agree, computes `KVCacheConfig` from the smallest per-rank memory report, and every
rank then allocates the same number of blocks, one tensor per layer in the layout of
its attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCacheTooSmallError(RuntimeError):
    """The memory left for the KV cache cannot hold one sequence of max_model_len."""


@dataclass(frozen=True)
class KVCacheSpec:
    """What one block of the cache holds on one rank, for every layer."""

    num_layers: int
    block_size: int
    num_kv_heads_per_rank: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers on one rank (K and V)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads_per_rank * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class KVCacheConfig(KVCacheSpec):
    """The spec plus the block count the engine chose; identical on every rank."""

    num_blocks: int

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, num_blocks: int) -> KVCacheConfig:
        return cls(spec.num_layers, spec.block_size, spec.num_kv_heads_per_rank, spec.head_dim, spec.dtype,
                   num_blocks)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, device: torch.device) -> list[torch.Tensor]:
    """One zeroed tensor of `shape` per layer. Zeroing touches every page, so the memory
    is really committed now rather than at the first long request."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
