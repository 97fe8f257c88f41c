"""The engine loop's metrics bookkeeping: each request's timeline (vLLM's
`RequestStateStats`) and, from every step's outputs and the scheduler's queues, the
calls on `EngineMetrics` (engine/metrics.py): TTFT, inter-token latency, the request
phases (queue, prefill, decode, inference), preemptions, generated tokens, gauges.

Owned by the engine-loop thread (engine/engine_loop.py); nothing here is locked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput
from engine.processor import EngineCoreRequest

if TYPE_CHECKING:
    from engine.core import EngineCore
    from engine.scheduler import Scheduler


@dataclass
class RequestStateStats:
    """One accepted request's timeline (time.monotonic() seconds) and token counts."""

    num_prompt_tokens: int
    deltas: bool  # its outputs carry only what is new (RequestOutputKind.DELTA)
    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens_seen: int = 0  # of the first sample: the request's timeline and histograms
    num_sample_tokens_seen: int = 0  # of every sample: generation_tokens_total
    num_preemptions: int = 0


class RequestStatsTracker:
    """Keeps a `RequestStateStats` per accepted, unfinished request and reports to `metrics`."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._requests: dict[str, RequestStateStats] = {}

    def on_request_added(self, request: EngineCoreRequest, deltas: bool) -> None:
        """The core accepted `request`."""
        self._requests[request.request_id] = RequestStateStats(len(request.prompt_token_ids), deltas,
                                                               request.arrival_time)
        params = request.sampling_params
        self.metrics.on_request_added(len(request.prompt_token_ids), params.max_tokens, getattr(params, "n", 1))

    def on_scheduled(self, scheduler: Scheduler, step_started: float) -> None:
        """After a step: when each request was first scheduled, and its preemptions."""
        for request in scheduler.running:
            stats = self._requests.get(request.request_id)
            if stats is not None and stats.scheduled_time is None:
                stats.scheduled_time = step_started
        for request in scheduler.waiting:  # preempted requests wait again
            stats = self._requests.get(request.request_id)
            if stats is not None and request.num_preemptions > stats.num_preemptions:
                self.metrics.on_preemptions(request.num_preemptions - stats.num_preemptions)
                stats.num_preemptions = request.num_preemptions

    def on_output(self, output: RequestOutput, now: float, step_started: float | None) -> int:
        """Record one output of a tracked request (its end, if finished); returns how
        many new tokens it brought over all its samples (several per step with
        multi-step scheduling). Untracked requests count nothing."""
        stats = self._requests.get(output.request_id)
        if stats is None:
            return 0
        if stats.scheduled_time is None:  # scheduled and done within this step
            stats.scheduled_time = step_started if step_started is not None else now
        num_tokens = len(output.token_ids) + (stats.num_tokens_seen if stats.deltas else 0)
        if num_tokens > stats.num_tokens_seen:
            if stats.first_token_time is None:
                stats.first_token_time = now
                self.metrics.on_first_token(now - stats.arrival_time)
                self.metrics.on_prefilled(stats.num_prompt_tokens)
            else:
                self.metrics.on_token(now - (stats.last_token_time or now))
            stats.last_token_time = now
            stats.num_tokens_seen = num_tokens
        # Every sample's tokens count as generated (n > 1), as vLLM counts its child requests'.
        all_tokens = sum(len(sample.token_ids) for sample in output.outputs)
        all_tokens += stats.num_sample_tokens_seen if stats.deltas else 0
        num_new_tokens = 0
        if all_tokens > stats.num_sample_tokens_seen:
            num_new_tokens = all_tokens - stats.num_sample_tokens_seen
            stats.num_sample_tokens_seen = all_tokens
        if output.finished:
            self._finish(output.request_id, output.finish_reason, now)
        return num_new_tokens

    def on_aborted(self, request_id: str, now: float) -> None:
        """Its consumer aborted a tracked request."""
        if request_id in self._requests:
            self._finish(request_id, "abort", now)

    def on_failed(self, request_id: str) -> None:
        """The engine died or shut down under a tracked request."""
        if self._requests.pop(request_id, None) is not None:
            self.metrics.on_request_finished("error")

    def update_gauges(self, core: EngineCore) -> None:
        """The scheduler's queues, KV usage, prefix-cache totals and worker restarts."""
        scheduler = core.scheduler
        block_manager = scheduler.block_manager
        self.metrics.set_scheduler_state(len(scheduler.running), len(scheduler.waiting), block_manager.usage)
        self.metrics.set_prefix_cache_totals(block_manager.stats.queries, block_manager.stats.hits)
        self.metrics.set_worker_restarts(core.num_worker_restarts)

    def _finish(self, request_id: str, finish_reason: str | None, now: float) -> None:
        """A request's end, with vLLM's request phases where they happened."""
        stats = self._requests.pop(request_id)
        if stats.first_token_time is None and finish_reason != "abort":
            self.metrics.on_prefilled(stats.num_prompt_tokens)  # scored, nothing generated
        scheduled, first, last = stats.scheduled_time, stats.first_token_time, stats.last_token_time
        self.metrics.on_request_finished(
            finish_reason, now - stats.arrival_time,
            num_prompt_tokens=stats.num_prompt_tokens, num_generation_tokens=stats.num_tokens_seen,
            queue_seconds=None if scheduled is None else scheduled - stats.arrival_time,
            prefill_seconds=None if scheduled is None or first is None else first - scheduled,
            decode_seconds=None if first is None or last is None else last - first,
            inference_seconds=None if scheduled is None else (last or now) - scheduled,
            num_preemptions=stats.num_preemptions,
        )
