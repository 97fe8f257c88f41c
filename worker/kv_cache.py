"""KV cache sizing and allocation.

The engine computes `KVCacheConfig` from the smallest per-rank memory report; every rank
then allocates the same number of blocks, one tensor per layer shaped
[num_blocks, 2, block_size, num_kv_heads_per_rank, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class KVCacheTooSmallError(RuntimeError):
    """The memory left for the KV cache cannot hold one sequence of max_model_len."""


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads_per_rank: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers on one rank (K and V)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads_per_rank * self.head_dim * self.dtype.itemsize

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_cache_config_for(config: Any, num_blocks: int) -> KVCacheConfig:
    """The cache layout for `config` (an EngineConfig) with `num_blocks` blocks per rank."""
    mc = config.model_config
    return KVCacheConfig(
        num_blocks=num_blocks,
        block_size=config.cache_config.block_size,
        num_layers=mc.num_layers,
        num_kv_heads_per_rank=mc.num_kv_heads_per_rank(config.parallel_config.tensor_parallel_size),
        head_dim=mc.head_dim,
        dtype=mc.dtype,
    )


def allocate_kv_cache(kv_cache_config: KVCacheConfig, device: torch.device) -> list[torch.Tensor]:
    """One zeroed tensor per layer. Zeroing touches every page, so the memory is really
    committed now rather than at the first long request."""
    c = kv_cache_config
    shape = (c.num_blocks, 2, c.block_size, c.num_kv_heads_per_rank, c.head_dim)
    return [torch.zeros(shape, dtype=c.dtype, device=device) for _ in range(c.num_layers)]
