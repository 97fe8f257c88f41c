"""The periodic stats line of a served engine, in vLLM's words.

Called by the AsyncEngine's loop thread after each iteration; logs at most once per
interval (``TP_LOG_STATS_INTERVAL`` seconds, default 10, as vLLM's
``VLLM_LOG_STATS_INTERVAL``), from the deltas of EngineMetrics since the last line.
An interval in which nothing was computed is logged at DEBUG only, so an idle server
stays quiet.
"""

from __future__ import annotations

import logging
import os
import time

from engine.metrics import EngineMetrics

logger = logging.getLogger("engine.stats")

LOG_STATS_INTERVAL_S = float(os.environ.get("TP_LOG_STATS_INTERVAL", "10"))


class LoggingStatLogger:
    def __init__(self, metrics: EngineMetrics, interval_s: float = LOG_STATS_INTERVAL_S) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last = metrics.snapshot()

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        current = self.metrics.snapshot()
        prompt = (current["prompt_tokens"] - self._last["prompt_tokens"]) / elapsed
        generation = (current["generation_tokens"] - self._last["generation_tokens"]) / elapsed
        queries = current["prefix_cache_queries"] - self._last["prefix_cache_queries"]
        hits = current["prefix_cache_hits"] - self._last["prefix_cache_hits"]
        busy = prompt or generation or current["num_running"] or current["num_waiting"]
        logger.log(
            logging.INFO if busy else logging.DEBUG,
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt, generation, current["num_running"], current["num_waiting"], 100 * current["kv_cache_usage"],
            100 * hits / queries if queries else 0.0,
        )
        self._last_time, self._last = now, current
