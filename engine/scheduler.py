"""FCFS continuous-batching scheduler with chunked prefill, prefix caching and
recompute preemption.

One rule covers prefill and decode alike (vLLM v1 style): every scheduled
request computes ``min(num_tokens + num_output_placeholders - num_computed_tokens,
remaining_budget)`` tokens this step. A request whose chunk reaches its last token
gets one new token sampled for it. At admission (first or after a preemption) the
block manager's cached prefix of the request counts as computed.

``num_computed_tokens`` advances when a step is scheduled, as in vLLM v1, so the
next step can be planned before this one's result is back (async scheduling): a
token the step in flight will sample is a placeholder
(``worker.outputs.PLACEHOLDER_TOKEN_ID``) in the next step's input, which every
rank replaces with the token it sampled itself.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Collection

from engine.block_manager import KVBlockManager
from engine.request import Request, RequestStatus
from engine.sched_utils import check_stop, ends_in_flight, num_decode_steps
from engine.structured_output import grammar_bitmask, step_grammar
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, step by step, which tokens of which requests the runner computes.

    Protocol: call :meth:`schedule`, run the model, then call
    :meth:`update_from_output` with that same ``SchedulerOutput``. Outputs are
    updated in the order they were scheduled, and at most one may be outstanding
    when :meth:`schedule` is called: synchronous engines update each before the
    next schedule; async scheduling plans step N+1 while step N runs. A request
    whose outstanding tokens will end it (``max_tokens``, ``max_model_len``) is
    not scheduled again; one that a stop token or a stop string ends had a step
    scheduled behind the one that ended it, whose result is dropped (at most one
    wasted token of compute per such request).

    Priority is arrival order (the order of :meth:`add_request` calls):
    ``running`` is kept sorted by it, so the last running request is always the
    preemption victim, and ``waiting`` is served strictly FCFS.

    Multi-step (``num_scheduler_steps`` > 1): when every running request is decoding
    and nobody waits, one output runs several decode steps back to back
    (``engine.sched_utils.num_decode_steps`` decides how many). Slots for all of them
    are allocated up front; the tokens are applied in order, so a stop token ends the
    request there and the steps after it are dropped.

    Capacity: a request finishes with ``"length"`` when it reaches ``max_model_len``
    tokens, or when it outgrows the whole KV cache (``num_blocks * block_size``
    tokens): ``engine.sched_utils.check_stop``.

    Structured outputs: each output carries the bitmask of the constrained requests
    that sample in it, filled when it is planned; with ``defer_grammar`` only their ids
    (``grammar_follows``): the engine asks :meth:`grammar_bitmask` once the step before
    is applied. A mask needs every earlier token, so without ``defer_grammar`` such a
    request is not planned while a step of it is in flight (async scheduling); a batch
    with one runs one step per output (logged once).
    Each token is taken into its matcher; a terminated (or refusing) grammar ends the
    request with "stop". A re-admitted request's matcher is `sync`ed to its kept tokens.
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
        num_scheduler_steps: int = 1,
        defer_grammar: bool = False,
    ) -> None:
        for name, value, least in (("max_num_seqs", max_num_seqs, 1),
                                   ("max_num_batched_tokens", max_num_batched_tokens, 1),
                                   ("max_model_len", max_model_len, 2),
                                   ("long_prefill_token_threshold", long_prefill_token_threshold, 0),
                                   ("num_scheduler_steps", num_scheduler_steps, 1)):
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        # Several ids can end generation (e.g. Llama 3's <|eot_id|> beside </s>).
        self.eos_token_ids: frozenset[int] = frozenset(
            () if eos_token_id is None else (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.num_scheduler_steps = num_scheduler_steps
        self.defer_grammar = defer_grammar  # the executor takes a step's bitmask after the step

        self.requests: dict[str, Request] = {}  # unfinished requests only
        self.waiting: deque[Request] = deque()  # sorted by arrival_index
        self.running: list[Request] = []  # sorted by arrival_index
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        # Scheduled, not yet updated: each output with the requests it scheduled, oldest first.
        self._outstanding: deque[tuple[SchedulerOutput, list[Request]]] = deque()
        self._next_arrival = 0
        self._capacity_tokens = block_manager.num_blocks * block_manager.block_size
        self._logged_single_step = False  # the multi-step-off-for-grammars line, once

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
            raise ValueError(f"request {request.request_id!r}: prompt has {n} tokens, but max_model_len is "
                             f"{self.max_model_len} (the prompt must be shorter to leave room for at least one "
                             "generated token)")
        if n > self._capacity_tokens:
            raise ValueError(f"request {request.request_id!r}: prompt has {n} tokens, but the whole KV cache holds "
                             f"only {self._capacity_tokens} tokens ({self.block_manager.num_blocks} blocks x "
                             f"{self.block_manager.block_size})")
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
    def num_outstanding_steps(self) -> int:
        """Outputs scheduled whose results have not been applied yet."""
        return len(self._outstanding)

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones FCFS.

        With a step outstanding (async scheduling), a victim preempted here may be in
        that step: its result is dropped when it comes (the request is no longer
        running), and its blocks, freed now, are reused only by steps the ranks run
        after that one."""
        if len(self._outstanding) > 1:
            raise RuntimeError(f"schedule() with {len(self._outstanding)} outputs outstanding: update the oldest "
                               "first (at most one step is planned ahead)")
        budget = self.max_num_batched_tokens
        num_steps = num_decode_steps(
            self.num_scheduler_steps, self.running, self.waiting, block_manager=self.block_manager,
            max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
            capacity_tokens=self._capacity_tokens)
        if num_steps > 1 and any(r.structured_output_request is not None for r in self.running):
            num_steps = 1  # every token of a constrained request needs a mask made after the one before
            if not self._logged_single_step:
                self._logged_single_step = True
                logger.info("num_scheduler_steps=%d: batches with structured-output requests run one step "
                            "per scheduler output (each step needs a grammar mask)", self.num_scheduler_steps)
        scheduled: list[ScheduledRequest] = []
        scheduled_requests: list[Request] = []
        preempted: list[Request] = []

        # Running requests, oldest first. Victims are popped from the tail, so
        # they are never requests already scheduled in this loop.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new <= 0 or ends_in_flight(request, self.max_model_len, self._capacity_tokens) or (
                    request.structured_output_request is not None and request.num_output_placeholders
                    and not self.defer_grammar):
                i += 1  # its outstanding step samples its last token, or the token its next mask needs
                continue
            while not self.block_manager.allocate_slots(request, num_new + num_steps - 1):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(self._schedule_chunk(request, num_new, num_steps=num_steps))
                scheduled_requests.append(request)
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
                if request.num_cached_tokens < 0:  # the first admission's hit, as vLLM reports it
                    request.num_cached_tokens = num_cached_tokens
                self.waiting.popleft()
                if request.structured_output_request is not None:
                    request.structured_output_request.sync(request.output_token_ids)
                request.status = RequestStatus.RUNNING
                bisect.insort(self.running, request, key=_arrival)
                scheduled.append(self._schedule_chunk(request, num_new, admitted=True))
                scheduled_requests.append(request)
                budget -= num_new

        # Preempted ids go out with this very output (they are not in its
        # `scheduled`), so the runner has dropped their state before they are
        # re-admitted from position 0 in a later step.
        finished_ids = self._finished_ids + [r.request_id for r in preempted]
        # An output with nothing scheduled never reaches the workers (EngineCore.step
        # skips it), so its ids are reported again with the next one.
        self._finished_ids = [] if scheduled else list(finished_ids)
        grammar_req_ids, grammar_bitmask = step_grammar(
            [(sched.req_id, request.structured_output_request)
             for sched, request in zip(scheduled, scheduled_requests) if sched.sample], defer=self.defer_grammar)
        output = SchedulerOutput(
            scheduled=scheduled,
            finished_req_ids=finished_ids,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            num_steps=num_steps if scheduled else 1,
            structured_output_req_ids=grammar_req_ids,
            grammar_bitmask=grammar_bitmask,
            grammar_follows=bool(grammar_req_ids) and grammar_bitmask is None,
        )
        if scheduled:
            self._outstanding.append((output, scheduled_requests))
        return output

    def grammar_bitmask(self, output: SchedulerOutput) -> bytes:
        """The bitmask of a ``grammar_follows`` output still outstanding, from its
        samples' matchers as they stand now (after the output before it was applied). A
        sample that ended since gets a row allowing everything: its token is dropped."""
        by_id = {r.request_id: r for r in next(reqs for out, reqs in self._outstanding if out is output)}
        samples = [by_id[req_id] for req_id in output.structured_output_req_ids]
        return grammar_bitmask([r.structured_output_request for r in samples],
                               [r.status == RequestStatus.RUNNING and self.requests.get(r.request_id) is r
                                for r in samples])

    def _num_new_tokens(self, request: Request, budget: int, num_cached_tokens: int = 0) -> int:
        num_new = min(request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
                      - num_cached_tokens, budget)
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return num_new

    def _schedule_chunk(self, request: Request, num_new: int, admitted: bool = False,
                        num_steps: int = 1) -> ScheduledRequest:
        """The message for ``request``'s next ``num_new`` tokens (slots already
        allocated, for ``num_steps - 1`` more tokens too); names the blocks they fill and
        advances the request past them and, in a multi-step output, past the tokens its
        later steps take in (each the one sampled the step before)."""
        start = request.num_computed_tokens
        end = start + num_new
        known = request.num_tokens
        last = known + request.num_output_placeholders
        # Blocks are named by their tokens: one that a placeholder fills is named by the
        # schedule after its token came back.
        self.block_manager.cache_full_blocks(request, min(end, known))
        token_ids = request.all_token_ids[start:end]
        if end > known:
            token_ids += [PLACEHOLDER_TOKEN_ID] * (end - max(start, known))
        params = request.sampling_params
        # The runner forgot a preempted request's params and history: it gets them again
        # at re-admission.
        send_history = admitted and (params.needs_history or params.prompt_logprobs is not None)
        scheduled = ScheduledRequest(
            req_id=request.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_ids=list(request.block_ids),
            sample=end == last,
            sampling_params=params if admitted else None,
            num_output_tokens=request.num_output_tokens + request.num_output_placeholders,
            history=(list(request.prompt_token_ids), list(request.output_token_ids)) if send_history else None,
        )
        request.num_computed_tokens = end + num_steps - 1
        if scheduled.sample:
            request.num_output_placeholders += num_steps
        return scheduled

    def preempt_all_running(self) -> int:
        """Preempt every running request by recompute (a replaced worker group, or a
        step that failed, left none of their K/V we can trust); the queue stays in
        arrival order. Outstanding outputs are void: their results must not be
        applied. Returns how many requests there were."""
        self._outstanding.clear()
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
        request.num_output_placeholders = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        # Victims leave in latest-arrival-first order, so pushing each to the
        # front keeps `waiting` sorted by arrival.
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply the results of the oldest outstanding step, ``scheduler_output``.

        Appends each sampled token (and logprobs, if requested) in place of its
        placeholder, applies stop conditions and frees finished requests; a
        multi-step output's tokens go in step order, each checked, and those after
        one that ends the request are dropped. Returns the requests that got a new
        token (finished ones included), in scheduled order. Requests that finished,
        were aborted or were preempted since the step was scheduled are skipped.
        Raises RuntimeError for an output that is not the oldest outstanding one, or
        a runner output with another number of steps.
        """
        if not self._outstanding or self._outstanding[0][0] is not scheduler_output:
            raise RuntimeError("update_from_output() must get the oldest outstanding SchedulerOutput "
                               "(outputs are applied in the order they were scheduled, each once)")
        _, requests = self._outstanding.popleft()
        token_steps = [runner_output.sampled_token_ids, *runner_output.later_token_ids]
        logprob_steps = [runner_output.logprobs, *runner_output.later_logprobs]
        if len(token_steps) != scheduler_output.num_steps or len(logprob_steps) != scheduler_output.num_steps:
            raise RuntimeError(f"runner returned {len(token_steps)} steps of tokens for an output of "
                               f"{scheduler_output.num_steps} steps")
        rows = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        updated: list[Request] = []
        for sched, request in zip(scheduler_output.scheduled, requests):
            if request.status != RequestStatus.RUNNING or self.requests.get(sched.req_id) is not request:
                continue  # ended (or preempted) since it was scheduled
            if sched.req_id in runner_output.prompt_logprobs:
                request.add_prompt_logprobs(*runner_output.prompt_logprobs[sched.req_id])
            if not sched.sample:
                continue
            row = rows.get(sched.req_id)
            if row is None:
                raise RuntimeError(f"runner returned no sampled token for {sched.req_id!r}")
            for tokens, step_logprobs in zip(token_steps, logprob_steps):
                token, logprobs = tokens[row], step_logprobs[row]
                request.num_output_placeholders -= 1
                if request.sampling_params.max_tokens == 0:  # prompt scoring: the prompt was all it wanted
                    status: RequestStatus | None = RequestStatus.FINISHED_LENGTH
                else:
                    request.append_output(token, logprobs)
                    status = check_stop(request, self.eos_token_ids, self.max_model_len, self._capacity_tokens)
                    grammar = request.structured_output_request
                    if grammar is not None and (not grammar.accept_token(token) or grammar.is_terminated()):
                        status = status or RequestStatus.FINISHED_STOPPED  # "length" stays "length"
                if status is not None:  # the later steps' tokens are dropped
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            updated.append(request)
        return updated

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.block_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)


def _arrival(request: Request) -> int:
    return request.arrival_index
