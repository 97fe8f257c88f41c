"""CacheConfig: the paged KV cache's block size, budget and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

# The KV budget per rank on the CPU when neither kv_cache_memory_bytes nor
# gpu_memory_utilization is given: a fixed space like vLLM's CPU backend, never a share
# of host memory (0.9 of a shared host's RAM took 19.6 GB and 5 s of zeroing).
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # set: skip profiling and use this many bytes per rank
    num_gpu_blocks_override: int | None = None  # set: exactly this many blocks, no profiling (vLLM's knob)
    # Full KV blocks are named by a hash of their tokens and reused by later prompts
    # that start the same way (engine/block_manager.py); on by default, as in vLLM.
    enable_prefix_caching: bool = True
