"""The periodic stats line of a served engine, in vLLM's words and order:

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, [Preemptions: 2, ]CPU KV cache usage: 41.3%,
    Prefix cache hit rate: 37.5%

Called by the AsyncEngine's loop thread after each iteration (at least once a second,
busy or idle); logs at most once per interval (``TP_LOG_STATS_INTERVAL`` seconds,
default 10, as vLLM's ``VLLM_LOG_STATS_INTERVAL``), from the deltas of EngineMetrics
since the last line. As in vLLM: the prompt throughput counts the prompt tokens
computed (prefilled minus those found in the prefix cache), "Preemptions" appears only
when the interval had some, the hit rate only once the prefix cache was queried, and
an interval in which nothing was computed, after one in which nothing was either, is
logged at DEBUG only, so an idle server stays quiet. `--disable-log-stats` turns the
line off (the AsyncEngine then has no stat logger).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from engine.metrics import EngineMetrics

if TYPE_CHECKING:
    from config import EngineConfig

logger = logging.getLogger("engine.stats")

LOG_STATS_INTERVAL_S = float(os.environ.get("TP_LOG_STATS_INTERVAL", "10"))


class LoggingStatLogger:
    """`maybe_log()` writes the line when an interval has passed. `device_type` names
    where the KV cache lives ("cuda" is printed GPU, as vLLM does; else upper-cased)."""

    def __init__(self, metrics: EngineMetrics, interval_s: float = LOG_STATS_INTERVAL_S,
                 device_type: str = "cpu") -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.kv_cache_device = "GPU" if device_type == "cuda" else device_type.upper()
        self._last_time = time.monotonic()
        self._last = metrics.snapshot()
        self._last_throughputs = (0.0, 0.0)
        self._hit_rate: float | None = None

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        current = self.metrics.snapshot()
        last = self._last
        queries = current["prefix_cache_queries"] - last["prefix_cache_queries"]
        hits = current["prefix_cache_hits"] - last["prefix_cache_hits"]
        computed = max(0, current["prompt_tokens"] - last["prompt_tokens"] - hits)
        prompt = computed / elapsed
        generation = (current["generation_tokens"] - last["generation_tokens"]) / elapsed
        preemptions = current["num_preemptions"] - last["num_preemptions"]
        if queries > 0:
            self._hit_rate = hits / queries
        idle = not any((prompt, generation, *self._last_throughputs))
        parts = ["Engine 000: Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]
        args: list[object] = [prompt, generation, current["num_running"], current["num_waiting"]]
        if preemptions > 0:
            parts.append("Preemptions: %d")
            args.append(preemptions)
        parts.append("%s KV cache usage: %.1f%%")
        args += [self.kv_cache_device, 100 * current["kv_cache_usage"]]
        if self._hit_rate is not None:
            parts.append("Prefix cache hit rate: %.1f%%")
            args.append(100 * self._hit_rate)
        logger.log(logging.DEBUG if idle else logging.INFO, ", ".join(parts), *args)
        self._last_time, self._last, self._last_throughputs = now, current, (prompt, generation)


def config_summary(config: EngineConfig) -> str:
    """The resolved configuration in one line, `key=value, ...` as vLLM's start-up line:
    the architecture, dtype and max_model_len the model resolved to, the executor
    backend the TP size resolved to, the load format and the KV settings."""
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    backend = config.parallel_config.distributed_executor_backend
    if backend is None:
        backend = "uni" if config.tensor_parallel_size == 1 else "mp"
    elif isinstance(backend, type):
        backend = backend.__name__
    fields = {
        "model": repr(config.model),
        "tokenizer": repr(getattr(config, "tokenizer", None) or config.model),
        "architecture": ",".join(mc.architectures) or "unknown",
        "dtype": str(mc.dtype),
        "max_model_len": mc.max_model_len,
        "tensor_parallel_size": config.tensor_parallel_size,
        "distributed_executor_backend": backend,
        "load_format": config.load_format,
        "quantization": config.quantization,
        "revision": config.revision,
        "device": config.device_config.device_type,
        "attention_backend": config.attention_config.backend,
        "tp_communicator": config.parallel_config.tp_communicator,
        "enforce_eager": config.compilation_config.enforce_eager,
        "cudagraph_capture_sizes": config.compilation_config.cudagraph_capture_sizes or None,
        "seed": config.seed,
        "block_size": cc.block_size,
        "kv_cache_memory_bytes": cc.kv_cache_memory_bytes,
        "gpu_memory_utilization": cc.gpu_memory_utilization,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enable_sleep_mode": config.enable_sleep_mode,
    }
    return ", ".join(f"{key}={value}" for key, value in fields.items())
