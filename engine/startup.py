"""EngineCore's start-up once the executor has started its workers: whether steps are
scheduled ahead, how many KV blocks every rank allocates, the scheduler over them, and
the start-up report (vLLM's memory and timing lines).

Called only from `EngineCore.__init__`, on the caller's thread; every function raises
before the core exists, and the core then shuts the workers down.
"""

from __future__ import annotations

import logging
from typing import Any

from config import ConfigError, EngineConfig
from distributed.utils import cdiv
from engine.block_hash import prefix_cache_salt
from engine.block_manager import KVBlockManager
from engine.scheduler import Scheduler
from executor.abstract import Executor
from worker.kv_cache import KVCacheConfig, KVCacheTooSmallError

logger = logging.getLogger(__name__)

GiB = 1 << 30
STARTUP_PHASES = ("spawn", "distributed_init", "load", "profile", "kv_alloc", "capture")


def resolve_async_scheduling(config: EngineConfig, executor_class: type[Executor]) -> bool:
    """`async_scheduling` None: on wherever the executor runs steps in the
    background. True with one that cannot is a ConfigError naming both."""
    wanted = config.scheduler_config.async_scheduling
    supported = executor_class.supports_async_scheduling
    if wanted and not supported:
        raise ConfigError(
            f"async_scheduling=True needs an executor that runs steps in the background "
            f"(distributed_executor_backend='mp'); {executor_class.__name__} runs each step on the engine's "
            "thread"
        )
    return supported if wanted is None else wanted


def initialize_kv_caches(executor: Executor, config: EngineConfig) -> KVCacheConfig:
    """Size the KV cache (the smallest rank's spare memory, or `num_gpu_blocks_override`),
    allocate it on every rank, then capture the CUDA graphs (where enabled). Raises KVCacheTooSmallError, with the memory figures
    used, when one sequence of max_model_len does not fit."""
    spec = executor.get_kv_cache_spec()
    block_bytes = spec.block_bytes
    override = config.cache_config.num_gpu_blocks_override
    if override is not None:  # the caller knows the block count it wants: no profile run
        available = [override * block_bytes] * config.parallel_config.world_size
    else:
        available = executor.determine_available_memory()
    num_blocks = min(available) // block_bytes
    max_len = config.model_config.max_model_len
    needed = cdiv(max_len, config.cache_config.block_size)
    if num_blocks < max(1, needed):
        raise KVCacheTooSmallError(
            f"the KV cache does not fit one sequence of max_model_len={max_len}: it needs {needed} blocks of "
            f"{block_bytes} bytes ({needed * block_bytes} bytes per rank), but the smallest rank can spare "
            f"{min(available)} bytes (per rank: {available}), i.e. {num_blocks} blocks. Raise "
            f"gpu_memory_utilization (now {config.cache_config.gpu_memory_utilization}) or "
            f"kv_cache_memory_bytes (now {config.cache_config.kv_cache_memory_bytes}), or lower "
            f"max_model_len or max_num_batched_tokens (now {config.scheduler_config.max_num_batched_tokens})."
        )
    kv_cache_config = KVCacheConfig.from_spec(spec, num_blocks)
    executor.initialize_from_config(kv_cache_config)
    executor.compile_or_warm_up_model()
    return kv_cache_config


def make_scheduler(config: EngineConfig, kv_cache_config: KVCacheConfig, eos_token_ids: list[int],
                   defer_grammar: bool = False) -> Scheduler:
    """The scheduler over the allocated blocks; cached blocks are named under a salt of
    what, besides the tokens, decides their K/V (model, revision, dtypes, load format).
    `defer_grammar`: the executor takes a step's grammar bitmask after the step."""
    mc = config.model_config
    salt = prefix_cache_salt(mc.model, mc.revision, str(mc.dtype), mc.quantization, config.load_format,
                             str(kv_cache_config.dtype))
    return Scheduler(
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        max_model_len=config.scheduler_config.max_model_len,
        block_manager=KVBlockManager(
            kv_cache_config.num_blocks,
            kv_cache_config.block_size,
            enable_caching=config.cache_config.enable_prefix_caching,
            hash_salt=salt,
        ),
        eos_token_id=eos_token_ids,
        num_scheduler_steps=config.scheduler_config.num_scheduler_steps,
        defer_grammar=defer_grammar,
    )


def gather_startup_timings(executor: Executor, config: EngineConfig, kv: KVCacheConfig,
                           total: float) -> dict[str, Any]:
    """Each phase's time (the slowest rank's; "spawn" the executor's), "total", and
    "per_rank" (each rank's own phases). Logs, as vLLM does at start-up, the weights
    and KV cache of each rank in GiB, the KV capacity in tokens and the maximum
    concurrency at max_model_len, then the phase timings."""
    per_rank = executor.worker_timings()
    timings: dict[str, Any] = {"total": total, "spawn": executor.startup_timings.get("spawn", 0.0)}
    for phase in STARTUP_PHASES[1:]:
        timings[phase] = max(rank.get(phase, 0.0) for rank in per_rank)
    timings["per_rank"] = per_rank
    # Each rank's weight bytes (parameters and buffers), as it measured them after loading.
    weights = executor.collective_rpc(lambda worker: getattr(worker, "model_memory_usage", None))
    if len(weights) != len(per_rank):  # external_launcher: only this rank answers
        weights = [None] * len(per_rank)
    logger.info(
        "Memory per rank: %s; KV cache %.4f GiB each (%d blocks of %d tokens)",
        ", ".join(f"rank {r}: weights {w / GiB:.4f} GiB" if w is not None else f"rank {r}: weights unknown"
                  for r, w in enumerate(weights)),
        kv.num_blocks * kv.block_bytes / GiB, kv.num_blocks, kv.block_size,
    )
    max_len = config.scheduler_config.max_model_len
    device = "GPU" if config.device_config.device_type == "cuda" else "CPU"
    logger.info("%s KV cache size: %s tokens; maximum concurrency for %d tokens per request: %.2fx",
                device, f"{kv.num_tokens:,}", max_len, kv.num_tokens / max_len)
    logger.info(
        "EngineCore ready in %.2fs (tp=%d, num_blocks=%d): %s (the slowest rank's); per rank: %s",
        total,
        config.tensor_parallel_size,
        kv.num_blocks,
        " | ".join(f"{p} {timings[p]:.3f}s" for p in STARTUP_PHASES),
        "; ".join(f"rank {r}: " + ", ".join(f"{p} {t:.3f}s" for p, t in rank.items())
                  for r, rank in enumerate(per_rank)),
    )
    return timings
