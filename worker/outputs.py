"""The messages of one step between the engine and every rank: what to run, what came out.

`SchedulerOutput` is built by the engine's Scheduler and broadcast to every rank, which
must all receive the same one; `ModelRunnerOutput` comes back from the output rank only.
They cross process boundaries, so they hold only builtins and `SamplingParams` (itself
a plain dataclass): no tensors, no locks.

Each pickles as its class and the tuple of its fields (`__reduce__`), not as a
dataclass's default (the class through copyreg, then a dict of its fields, set one by
one): the step's messages are pickled and unpickled once per step, on the engine and
on every rank, right after the model code has evicted every cache, where 32 decode
requests cost 120 µs to dump and 100 µs to load this way against 170 and 170.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config import SamplingParams

# In ``ScheduledRequest.token_ids``: the token this request's previous step samples,
# scheduled before that step's result came back (async scheduling). Every rank samples
# the same token, so each puts its own in this place.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ScheduledRequest:
    """One request's work for one step.

    ``token_ids`` are the tokens whose KV this step computes, starting at
    absolute position ``start_pos``; the last may be ``PLACEHOLDER_TOKEN_ID``, the
    token the request's previous step samples (async scheduling). ``block_ids`` is the whole block table
    after allocation. ``sample`` is True iff the chunk reaches the last known
    token, i.e. the runner must sample exactly one new token for it.
    ``num_output_tokens`` (outputs so far) keys the per-step random stream so
    sampling is independent of batching, preemption and rank.
    ``sampling_params`` comes once, when the request is admitted (again after a
    preemption), and is None in its later steps: the runner keeps it until the id
    appears in ``finished_req_ids`` (pickling 32 requests' params cost the engine and
    every rank about 0.3 ms a decode step).
    ``history`` (prompt ids, output ids so far) comes once, at the same times, if its
    sampling needs the tokens it has seen (penalties, bad words) or its prompt's
    logprobs; the runner keeps it as long.
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams | None
    num_output_tokens: int
    history: tuple[list[int], list[int]] | None = None

    def __reduce__(self) -> tuple[type, tuple]:
        return ScheduledRequest, _SCHEDULED_FIELDS(self)


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step.

    ``finished_req_ids`` lists requests finished, aborted or preempted since
    the previous step; the runner drops any per-request state it holds. An
    output with nothing scheduled is never run, so its ids come again in the
    next one. ``num_steps`` > 1 (multi-step, every request decoding one token):
    the runner runs that many steps back to back, each request's next step taking
    in the token its step before sampled, at the next position; the slots for all
    of them are in each request's ``block_ids``.
    """

    scheduled: list[ScheduledRequest]
    finished_req_ids: list[str]
    num_batched_tokens: int
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def __reduce__(self) -> tuple[type, tuple]:
        return SchedulerOutput, _SCHEDULER_OUTPUT_FIELDS(self)


@dataclass
class ModelRunnerOutput:
    """Result of one step: one sampled token per ``sample=True`` request.

    Lists are parallel and in scheduled order. ``logprobs[i]`` maps token id to
    logprob for the top-k plus the sampled token, or is None if not requested.
    ``prompt_logprobs[req_id] = (position, entries, ranks)``: for the prompt tokens
    at ``position``, ``position + 1``, ... (each predicted by the one before it) the
    top-k plus the actual token's logprob, and its rank; only for requests that asked.
    A multi-step output (``SchedulerOutput.num_steps`` > 1) has the first step's
    tokens here and each later step's in ``later_token_ids`` / ``later_logprobs``,
    one list per step, parallel to ``req_ids``.
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]], list[int]]] = field(default_factory=dict)
    later_token_ids: list[list[int]] = field(default_factory=list)
    later_logprobs: list[list[dict[int, float] | None]] = field(default_factory=list)

    def __reduce__(self) -> tuple[type, tuple]:
        return ModelRunnerOutput, _RUNNER_OUTPUT_FIELDS(self)


def _field_getter(cls: type) -> attrgetter:
    """All of a dataclass's fields, in its constructor's order, as one tuple."""
    return attrgetter(*(f.name for f in fields(cls)))


_SCHEDULED_FIELDS = _field_getter(ScheduledRequest)
_SCHEDULER_OUTPUT_FIELDS = _field_getter(SchedulerOutput)
_RUNNER_OUTPUT_FIELDS = _field_getter(ModelRunnerOutput)
