"""Serving metrics and their Prometheus text rendering (no client library needed).

The engine-loop thread updates them after every step; the HTTP thread renders them.
One lock guards all values, so a scrape sees a consistent snapshot.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

PREFIX = "tp_runtime_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Cumulative-bucket histogram, Prometheus style."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            cumulative += n
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        lines += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return lines


class EngineMetrics:
    """Counters, gauges and histograms of one served engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_received = 0
        self.requests_rejected = 0
        self.requests_finished = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.engine_healthy = 1
        self.step_time = Histogram(STEP_TIME_BUCKETS)
        self.time_to_first_token = Histogram(LATENCY_BUCKETS)
        self.e2e_latency = Histogram(LATENCY_BUCKETS)

    # --------------------------------------------------------------- updates

    def on_request_rejected(self) -> None:
        with self._lock:
            self.requests_rejected += 1

    def on_request_added(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.requests_received += 1
            self.prompt_tokens += num_prompt_tokens

    def on_request_finished(self, finish_reason: str | None, e2e_seconds: float | None = None) -> None:
        reason = finish_reason if finish_reason in self.requests_finished else "error"
        with self._lock:
            self.requests_finished[reason] += 1
            if e2e_seconds is not None:
                self.e2e_latency.observe(e2e_seconds)

    def on_first_token(self, seconds: float) -> None:
        with self._lock:
            self.time_to_first_token.observe(seconds)

    def on_step(self, seconds: float, num_new_tokens: int) -> None:
        with self._lock:
            self.step_time.observe(seconds)
            self.generation_tokens += num_new_tokens

    def set_scheduler_state(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        with self._lock:
            self.num_running = num_running
            self.num_waiting = num_waiting
            self.kv_cache_usage = kv_cache_usage

    def set_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """The block manager's cumulative counts, in tokens (it owns them; this mirrors)."""
        with self._lock:
            self.prefix_cache_queries = queries
            self.prefix_cache_hits = hits

    def snapshot(self) -> dict[str, float]:
        """The values the periodic log line needs, read under the lock."""
        with self._lock:
            return {
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "num_running": self.num_running,
                "num_waiting": self.num_waiting,
                "kv_cache_usage": self.kv_cache_usage,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
            }

    def set_healthy(self, healthy: bool) -> None:
        with self._lock:
            self.engine_healthy = int(healthy)

    # -------------------------------------------------------------- rendering

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, lines: list[str]) -> None:
            out.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}", *lines])

        p = PREFIX
        with self._lock:
            metric("requests_received_total", "counter", "Requests accepted by the engine.",
                   [f"{p}requests_received_total {self.requests_received}"])
            metric("requests_rejected_total", "counter", "Requests refused as invalid (HTTP 4xx).",
                   [f"{p}requests_rejected_total {self.requests_rejected}"])
            metric("requests_finished_total", "counter", "Requests that ended, by finish reason.",
                   [f'{p}requests_finished_total{{finish_reason="{r}"}} {n}'
                    for r, n in self.requests_finished.items()])
            metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                   [f"{p}prompt_tokens_total {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   [f"{p}generation_tokens_total {self.generation_tokens}"])
            metric("num_requests_running", "gauge", "Requests in the running batch.",
                   [f"{p}num_requests_running {self.num_running}"])
            metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
                   [f"{p}num_requests_waiting {self.num_waiting}"])
            metric("kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use (0..1).",
                   [f"{p}kv_cache_usage_ratio {self.kv_cache_usage!r}"])
            metric("prefix_cache_queries_total", "counter",
                   "Prompt tokens looked up in the prefix cache when requests were admitted.",
                   [f"{p}prefix_cache_queries_total {self.prefix_cache_queries}"])
            metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not recomputed).",
                   [f"{p}prefix_cache_hits_total {self.prefix_cache_hits}"])
            metric("engine_healthy", "gauge", "1 while every worker is alive, else 0.",
                   [f"{p}engine_healthy {self.engine_healthy}"])
            metric("engine_step_seconds", "histogram", "Wall time of one engine step.",
                   self.step_time.render(f"{p}engine_step_seconds"))
            metric("time_to_first_token_seconds", "histogram", "From arrival to the first generated token.",
                   self.time_to_first_token.render(f"{p}time_to_first_token_seconds"))
            metric("e2e_request_latency_seconds", "histogram", "From arrival to the last token.",
                   self.e2e_latency.render(f"{p}e2e_request_latency_seconds"))
        return "\n".join(out) + "\n"
