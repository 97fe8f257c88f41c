"""Serving metrics, exposed at /metrics in the Prometheus text format (prometheus_client).

The metric set, names, types and labels are vLLM's with `tp_runtime:` in place of
`vllm:` (so `vllm:num_requests_running` is `tp_runtime:num_requests_running`), and
every series carries `model_name` (the first served model name) and `engine` ("0"),
so vLLM's Grafana dashboard works once its prefix is replaced. The histograms use
vLLM's default buckets; `cache_config_info`, as in vLLM, is labelled with the cache
config's fields and `engine` only. A few series of our own have no vLLM counterpart:
`tp_runtime:requests_received_total`, `tp_runtime:requests_rejected_total` (HTTP
400s), `tp_runtime:engine_healthy` and `tp_runtime:engine_step_seconds`.

Each EngineMetrics owns its CollectorRegistry (never the process-global one), so
several engines or apps in one process do not collide. The engine-loop thread
updates the metrics after every step; the HTTP thread renders them. The plain
totals that the periodic log line reads are kept under one lock beside them.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX = "tp_runtime:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's default buckets (vllm/v1/metrics/buckets.py), so that dashboards' quantiles agree.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's iteration_tokens_total buckets (vllm/v1/metrics/buckets.py).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class EngineMetrics:
    """The metrics of one served engine, in their own registry.

    `model_name` labels every series; `max_model_len` caps the token-count buckets.
    Update methods may be called from any thread.
    """

    def __init__(self, model_name: str = "", max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        labels = ["model_name", "engine"]
        values = (model_name, "0")
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple | list) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=reg, buckets=buckets).labels(*values)

        token_buckets = request_tokens_buckets(max_model_len)
        self._running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self._kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._prefix_queries = counter("prefix_cache_queries",
                                       "Prefix cache queries, in terms of number of queried tokens.")
        self._prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self._prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        sleep_state = Gauge(PREFIX + "engine_sleep_state",
                            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
                            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                            [*labels, "sleep_state"], registry=reg)
        self._sleep_state = {state: sleep_state.labels(*values, state)
                             for state in ("awake", "weights_offloaded", "discard_all")}
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=reg)
        self._success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self._req_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                            token_buckets)
        self._req_generation_tokens = histogram("request_generation_tokens",
                                                "Number of generation tokens processed.", token_buckets)
        self._req_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self._req_params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                       REQUEST_PARAMS_N_BUCKETS)
        self._req_params_max_tokens = histogram("request_params_max_tokens",
                                                "Histogram of the max_tokens request parameter.", token_buckets)
        self._ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                               TIME_TO_FIRST_TOKEN_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              INTER_TOKEN_LATENCY_BUCKETS)
        self._tpot = histogram("request_time_per_output_token_seconds",
                               "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                              REQUEST_LATENCY_BUCKETS)
        self._queue_time = histogram("request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self._inference_time = histogram("request_inference_time_seconds",
                                         "Histogram of time spent in RUNNING phase for request.",
                                         REQUEST_LATENCY_BUCKETS)
        self._prefill_time = histogram("request_prefill_time_seconds",
                                       "Histogram of time spent in PREFILL phase for request.",
                                       REQUEST_LATENCY_BUCKETS)
        self._decode_time = histogram("request_decode_time_seconds",
                                      "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self._iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                           ITERATION_TOKENS_BUCKETS)
        self._req_preemptions = histogram("request_num_preemptions",
                                          "Histogram of the number of times a request was preempted.",
                                          REQUEST_NUM_PREEMPTIONS_BUCKETS)
        # Ours: no vLLM counterpart.
        self._received = counter("requests_received", "Requests accepted by the engine.")
        self._rejected = counter("requests_rejected", "Requests refused as invalid (HTTP 400).")
        self._healthy = gauge("engine_healthy", "1 while every worker is alive, else 0.")
        self._step_time = histogram("engine_step_seconds", "Wall time of one engine step.", STEP_TIME_BUCKETS)
        self._worker_restarts = counter("worker_restarts", "Times a dead or hung worker group was replaced "
                                                           "(--max-worker-restarts).")
        self._healthy.set(1)
        self.set_sleep_state(False)
        self._cache_config_info_set = False

        # Plain totals for the log line and for in-process readers, under self._lock.
        self.requests_received = 0
        self.requests_rejected = 0
        self.requests_finished = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.worker_restarts = 0
        self.engine_healthy = 1

    # --------------------------------------------------------------- updates

    def on_request_rejected(self) -> None:
        with self._lock:
            self.requests_rejected += 1
        self._rejected.inc()

    def on_request_added(self, num_prompt_tokens: int, max_tokens: int | None = None, n: int = 1) -> None:
        """A request the engine accepted (its prompt counts once prefilled: `on_prefilled`)."""
        with self._lock:
            self.requests_received += 1
        self._received.inc()
        self._req_params_n.observe(n)
        if max_tokens is not None:
            self._req_params_max_tokens.observe(max_tokens)
            self._req_max_generation_tokens.observe(max_tokens)

    def on_prefilled(self, num_prompt_tokens: int) -> None:
        """A request's prompt has been processed (cached tokens included, as vLLM counts)."""
        with self._lock:
            self.prompt_tokens += num_prompt_tokens
        self._prompt_tokens.inc(num_prompt_tokens)

    def on_first_token(self, seconds: float) -> None:
        """Time to first token: from arrival to the first generated token."""
        self._ttft.observe(seconds)

    def on_token(self, seconds: float) -> None:
        """Inter-token latency: one request's time since its previous token."""
        self._itl.observe(seconds)

    def on_preemptions(self, count: int) -> None:
        with self._lock:
            self.num_preemptions += count
        self._preemptions.inc(count)

    def on_request_finished(
        self,
        finish_reason: str | None,
        e2e_seconds: float | None = None,
        *,
        num_prompt_tokens: int | None = None,
        num_generation_tokens: int | None = None,
        queue_seconds: float | None = None,
        prefill_seconds: float | None = None,
        decode_seconds: float | None = None,
        inference_seconds: float | None = None,
        num_preemptions: int | None = None,
    ) -> None:
        """A request ended; any reason outside FINISH_REASONS counts as "error".
        The optional phase times are observed when given (vLLM's request phases:
        queue = arrival to first scheduled, prefill = scheduled to first token,
        decode = first to last token, inference = scheduled to last token)."""
        reason = finish_reason if finish_reason in self._success else "error"
        with self._lock:
            self.requests_finished[reason] += 1
        self._success[reason].inc()
        if e2e_seconds is not None:
            self._e2e.observe(e2e_seconds)
        if num_prompt_tokens is not None:
            self._req_prompt_tokens.observe(num_prompt_tokens)
        if num_generation_tokens is not None:
            self._req_generation_tokens.observe(num_generation_tokens)
        for histogram, value in ((self._queue_time, queue_seconds), (self._prefill_time, prefill_seconds),
                                 (self._decode_time, decode_seconds), (self._inference_time, inference_seconds),
                                 (self._req_preemptions, num_preemptions)):
            if value is not None:
                histogram.observe(value)
        if decode_seconds is not None and num_generation_tokens is not None and num_generation_tokens > 1:
            self._tpot.observe(decode_seconds / (num_generation_tokens - 1))

    def on_step(self, seconds: float, num_new_tokens: int, num_batched_tokens: int | None = None) -> None:
        """One engine step: its wall time, the tokens it generated, and the tokens it
        ran (prompt and decode; vLLM's iteration_tokens_total), when it ran any."""
        with self._lock:
            self.generation_tokens += num_new_tokens
        self._step_time.observe(seconds)
        self._generation_tokens.inc(num_new_tokens)
        if num_batched_tokens:
            self._iteration_tokens.observe(num_batched_tokens)

    def set_cache_config_info(self, info: dict[str, object]) -> None:
        """vLLM's cache_config_info: a gauge at 1 whose labels are the cache config's
        fields (and `engine`), each value as a string. The first call wins."""
        if self._cache_config_info_set:  # a second AsyncEngine on the same metrics
            return
        labels = {key: str(value) for key, value in info.items()}
        labels["engine"] = "0"
        Gauge(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig", list(labels),
              registry=self.registry).labels(**labels).set(1)
        self._cache_config_info_set = True

    def set_scheduler_state(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        with self._lock:
            self.num_running = num_running
            self.num_waiting = num_waiting
            self.kv_cache_usage = kv_cache_usage
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv_usage.set(kv_cache_usage)

    def set_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """The block manager's cumulative counts, in tokens (it owns them; the
        counters follow them by their increase)."""
        with self._lock:
            new_queries, new_hits = queries - self.prefix_cache_queries, hits - self.prefix_cache_hits
            self.prefix_cache_queries, self.prefix_cache_hits = queries, hits
        if new_queries > 0:
            self._prefix_queries.inc(new_queries)
        if new_hits > 0:
            self._prefix_hits.inc(new_hits)

    def set_worker_restarts(self, total: int) -> None:
        """The core's count of worker-group restarts (the counter follows its increase)."""
        with self._lock:
            new, self.worker_restarts = total - self.worker_restarts, max(total, self.worker_restarts)
        if new > 0:
            self._worker_restarts.inc(new)

    def set_sleep_state(self, sleeping: bool, level: int = 0) -> None:
        """vLLM's engine_sleep_state: awake, or asleep at `level` (1 weights offloaded,
        2 discarded; 0, a pause, sets neither)."""
        self._sleep_state["awake"].set(0 if sleeping else 1)
        self._sleep_state["weights_offloaded"].set(int(sleeping and level == 1))
        self._sleep_state["discard_all"].set(int(sleeping and level == 2))

    def set_healthy(self, healthy: bool) -> None:
        with self._lock:
            self.engine_healthy = int(healthy)
        self._healthy.set(int(healthy))

    # -------------------------------------------------------------- reading

    def snapshot(self) -> dict[str, float]:
        """The totals the periodic log line needs, read together under the lock."""
        with self._lock:
            return {
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "num_preemptions": self.num_preemptions,
                "num_running": self.num_running,
                "num_waiting": self.num_waiting,
                "kv_cache_usage": self.kv_cache_usage,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
            }

    def render(self) -> str:
        """Every series in the Prometheus text exposition format (CONTENT_TYPE)."""
        return generate_latest(self.registry).decode()
