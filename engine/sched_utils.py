"""The Scheduler's per-request rules (vLLM's `v1/core/sched/utils.py`): when a request
stops, and how many decode steps one output may run back to back.

Pure functions of the requests and limits they are given; called by
engine/scheduler.py only, in the engine process, on the thread that runs the step.
They change nothing but `request.stop_reason` (set by `check_stop` for a stop token).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_manager import KVBlockManager
from engine.request import Request, RequestStatus


def reaches_length_limit(request: Request, max_model_len: int, capacity_tokens: int, num_pending: int = 0) -> bool:
    """Whether ``request``, once ``num_pending`` more tokens are sampled, has all it may
    have: ``max_tokens`` outputs, ``max_model_len`` tokens, or more tokens than the whole
    KV cache holds (``capacity_tokens``; it could never be scheduled again, and would
    livelock preempting itself). The next step would need KV for all of its tokens."""
    total = request.num_tokens + num_pending
    return (request.num_output_tokens + num_pending >= request.sampling_params.max_tokens
            or total >= max_model_len or total > capacity_tokens)


def ends_in_flight(request: Request, max_model_len: int, capacity_tokens: int) -> bool:
    """Whether the tokens that ``request``'s outstanding steps sample (its placeholders)
    will end it by length: such a request is not scheduled again."""
    pending = request.num_output_placeholders
    return pending > 0 and reaches_length_limit(request, max_model_len, capacity_tokens, pending)


def check_stop(request: Request, eos_token_ids: frozenset[int], max_model_len: int,
               capacity_tokens: int) -> RequestStatus | None:
    """The stop conditions on ``request``'s newest output token, or None to go on; "stop"
    (an EOS token unless ``ignore_eos``, or one of ``stop_token_ids``, which it records
    as ``request.stop_reason``) wins over "length" (:func:`reaches_length_limit`). Stop
    strings are the engine's (they need the text): see ``Scheduler.finish_request``."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last in eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if last in params.stop_token_ids:
        request.stop_reason = last
        return RequestStatus.FINISHED_STOPPED
    if reaches_length_limit(request, max_model_len, capacity_tokens):
        return RequestStatus.FINISHED_LENGTH
    return None


def num_decode_steps(num_scheduler_steps: int, running: Sequence[Request], waiting: Sequence[Request], *,
                     block_manager: KVBlockManager, max_model_len: int, max_num_batched_tokens: int,
                     capacity_tokens: int) -> int:
    """How many decode steps the next output runs (vLLM V0's ``--num-scheduler-steps``).

    ``num_scheduler_steps`` when every running request that will be scheduled decodes one
    token, nobody waits for admission, no request has stop strings (found in the text,
    after each token) and the cache has room for every step's slot; never more than any
    of them may still generate (``max_tokens``, the model length, the whole cache), so no
    step runs past a length limit. Else 1: a step with a prefill chunk, a waiting request
    or stop strings stays single.

    The steps of one output run back to back on the ranks, each feeding its sampled token
    to the next (``SchedulerOutput.num_steps``), so the engine's own work per step
    (schedule, send, collect, apply) is paid once per that many tokens; a new request
    waits up to that many steps."""
    steps = num_scheduler_steps
    if steps == 1 or waiting:
        return 1
    candidates = []
    for request in running:
        if ends_in_flight(request, max_model_len, capacity_tokens):
            continue  # not scheduled: its step in flight ends it
        pending = request.num_output_placeholders
        params = request.sampling_params
        total = request.num_tokens + pending
        if params.stop or total - request.num_computed_tokens != 1:
            return 1
        left = params.max_tokens - request.num_output_tokens - pending
        steps = min(steps, left, max_model_len - total, capacity_tokens - total)
        candidates.append(request)
    if steps <= 1 or len(candidates) > max_num_batched_tokens:
        return 1
    needed = sum(block_manager.blocks_needed(r, steps) for r in candidates)
    return steps if needed <= block_manager.num_free_blocks else 1
