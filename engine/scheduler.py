"""FCFS continuous-batching scheduler with chunked prefill, prefix caching and
recompute preemption.

One rule covers prefill and decode alike (vLLM v1 style): every scheduled
request computes ``min(num_tokens - num_computed_tokens, remaining_budget)``
tokens this step. A request whose chunk reaches its last known token gets one
new token sampled for it. At admission (first or after a preemption) the block
manager's cached prefix of the request counts as computed.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection

from engine.block_manager import KVBlockManager
from engine.request import Request, RequestStatus
from worker.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


class Scheduler:
    """Decides, step by step, which tokens of which requests the runner computes.

    Protocol: call :meth:`schedule`, run the model, then call
    :meth:`update_from_output` with that same ``SchedulerOutput`` before the
    next :meth:`schedule` (one step in flight at a time).

    Priority is arrival order (the order of :meth:`add_request` calls):
    ``running`` is kept sorted by it, so the last running request is always the
    preemption victim, and ``waiting`` is served strictly FCFS.

    Capacity: a request finishes with ``"length"`` when it reaches
    ``max_model_len`` tokens, or when it outgrows the whole KV cache
    (``num_blocks * block_size`` tokens) — otherwise it could never be scheduled
    again and would livelock preempting itself.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_manager: KVBlockManager,
        eos_token_id: int | Collection[int] | None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {long_prefill_token_threshold}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        # Several ids can end generation (e.g. Llama 3's <|eot_id|> beside </s>).
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset({eos_token_id})
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.long_prefill_token_threshold = long_prefill_token_threshold

        self.requests: dict[str, Request] = {}  # unfinished requests only
        self.waiting: deque[Request] = deque()  # sorted by arrival_index
        self.running: list[Request] = []  # sorted by arrival_index
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        self._next_arrival = 0
        self._capacity_tokens = block_manager.num_blocks * block_manager.block_size

    # ------------------------------------------------------------------ intake

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (status WAITING) behind all earlier ones.

        Overwrites ``request.arrival_index`` with the scheduler's own counter so
        that FCFS order is exactly the order of calls. Raises ``ValueError`` for
        an empty prompt, a prompt of ``max_model_len`` tokens or more, a prompt
        larger than the whole KV cache, or a duplicate unfinished request id.
        """
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id!r}: prompt must not be empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {n} tokens, "
                f"but max_model_len is {self.max_model_len} (the prompt must be "
                f"shorter to leave room for at least one generated token)"
            )
        if n > self._capacity_tokens:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {n} tokens, but the whole "
                f"KV cache holds only {self._capacity_tokens} tokens "
                f"({self.block_manager.num_blocks} blocks x {self.block_manager.block_size})"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """Finish ``request_id`` as aborted and free its blocks; unknown ids are a no-op."""
        self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish an unfinished request with ``status`` (the engine's own stop conditions,
        such as a stop string, or an abort) and free its blocks; unknown ids are a no-op."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones FCFS."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        # Running requests, oldest first. Victims are popped from the tail, so
        # they are never requests already scheduled in this loop.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self.block_manager.cache_full_blocks(request, request.num_computed_tokens + num_new)
                scheduled.append(self._make_scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Admitting new work right after preempting would only thrash: the
        # victims are at the head of the queue and the cache is full.
        if not preempted:
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                request = self.waiting[0]
                # A cached prefix counts as computed: only the tokens after it are run.
                # Prompt logprobs need every prompt position computed, so they take none.
                wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
                cached = [] if wants_prompt_logprobs else self.block_manager.get_computed_blocks(request)
                num_cached_tokens = len(cached) * self.block_manager.block_size
                num_new = self._num_new_tokens(request, budget, num_cached_tokens)
                if not self.block_manager.allocate_slots(request, num_new, cached):
                    break  # strict FCFS: nobody overtakes the head of the queue
                self.block_manager.record_lookup(request.num_tokens, num_cached_tokens)
                self.block_manager.cache_full_blocks(request, request.num_computed_tokens + num_new)
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=_arrival)
                scheduled.append(self._make_scheduled(request, num_new, admitted=True))
                budget -= num_new

        # Preempted ids go out with this very output (they are not in its
        # `scheduled`), so the runner has dropped their state before they are
        # re-admitted from position 0 in a later step.
        finished_ids = self._finished_ids + [r.request_id for r in preempted]
        # An output with nothing scheduled never reaches the workers (EngineCore.step
        # skips it), so its ids are reported again with the next one.
        self._finished_ids = [] if scheduled else list(finished_ids)
        return SchedulerOutput(
            scheduled=scheduled,
            finished_req_ids=finished_ids,
            num_batched_tokens=self.max_num_batched_tokens - budget,
        )

    def _num_new_tokens(self, request: Request, budget: int, num_cached_tokens: int = 0) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens - num_cached_tokens, budget)
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return num_new

    def _make_scheduled(self, request: Request, num_new: int, admitted: bool = False) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        params = request.sampling_params
        # The runner forgot a preempted request's params and history: it gets them again
        # at re-admission.
        send_history = admitted and (params.needs_history or params.prompt_logprobs is not None)
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_pos=start,
            block_ids=list(request.block_ids),
            sample=end == request.num_tokens,
            sampling_params=params if admitted else None,
            num_output_tokens=request.num_output_tokens,
            history=(list(request.prompt_token_ids), list(request.output_token_ids)) if send_history else None,
        )

    def preempt_all_running(self) -> int:
        """Preempt every running request by recompute (a replaced worker group has none
        of their K/V); the queue stays in arrival order. Returns how many there were."""
        running, self.running = self.running, []
        # Latest arrival first: each goes to the front of the queue, as schedule() preempts.
        for request in reversed(running):
            self._preempt(request)
        return len(running)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: release its blocks (named ones stay cached); it
        re-prefills prompt + outputs later, from after whatever prefix is still cached."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        # Victims leave in latest-arrival-first order, so pushing each to the
        # front keeps `waiting` sorted by arrival.
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply one step's results.

        Advances ``num_computed_tokens`` for every scheduled request, appends
        each sampled token (and logprobs, if requested), applies stop
        conditions and frees finished requests. Returns the requests that got a
        new token this step (finished ones included), in scheduled order.
        Requests aborted while the step was in flight are skipped.
        """
        samples = {
            req_id: (token, logprobs)
            for req_id, token, logprobs in zip(
                runner_output.req_ids, runner_output.sampled_token_ids, runner_output.logprobs
            )
        }
        updated: list[Request] = []
        for sched in scheduler_output.scheduled:
            request = self.requests.get(sched.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted mid-step
            request.num_computed_tokens += len(sched.token_ids)
            if sched.req_id in runner_output.prompt_logprobs:
                request.add_prompt_logprobs(*runner_output.prompt_logprobs[sched.req_id])
            if not sched.sample:
                continue
            if sched.req_id not in samples:
                raise RuntimeError(f"runner returned no sampled token for {sched.req_id!r}")
            token, logprobs = samples[sched.req_id]
            if request.sampling_params.max_tokens == 0:  # prompt scoring: the prompt was all it wanted
                status: RequestStatus | None = RequestStatus.FINISHED_LENGTH
            else:
                request.append_output(token, logprobs)
                status = self._check_stop(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """Stop conditions on the newest token; "stop" wins over "length"."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        # The next step would need KV for all num_tokens tokens.
        if request.num_tokens >= self.max_model_len or request.num_tokens > self._capacity_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.block_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)


def _arrival(request: Request) -> int:
    return request.arrival_index
