"""The messages of one step between the engine and every rank: what to run, what came out.

`SchedulerOutput` is built by the engine's Scheduler and broadcast to every rank, which
must all receive the same one; `ModelRunnerOutput` comes back from the output rank only.
They cross process boundaries, so they hold only builtins and `SamplingParams` (itself
a plain dataclass): no tensors, no locks.

Each is a `msgspec.Struct` (vLLM's engine-core messages are too): typed, and encoded as
a MessagePack array of its fields in declaration order (``array_like``), so the engine
encodes a step once and each rank decodes it straight into these classes
(`executor/serial_utils.py`). A decode step of 32 requests, in its execute_model request,
costs 7 µs to encode and 28 to decode this way, against 35 and 36 to pickle as the
dataclasses they were (hot loop, `scripts/bench_rpc.py --step-messages`, 2026-12-04 on a
2-core VM). They still pickle (as their class and the tuple of their fields), for the
paths that pickle whole calls (Ray, torchrun). ``gc=False``: they hold only builtins and
never a cycle, so the collector need not track the thousands a busy engine makes.
"""

from __future__ import annotations

from typing import Any

import msgspec

# In ``ScheduledRequest.token_ids``: the token this request's previous step samples,
# scheduled before that step's result came back (async scheduling). Every rank samples
# the same token, so each puts its own in this place.
PLACEHOLDER_TOKEN_ID = -1


class ScheduledRequest(msgspec.Struct, array_like=True, gc=False):
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
    # A config.SamplingParams, or None. Typed Any for msgspec, which would decode the
    # dataclass by running its __post_init__ (its checks, 4 µs) again on every rank:
    # executor/serial_utils.py sends its fields' values and rebuilds it as pickle would.
    sampling_params: Any
    num_output_tokens: int
    history: tuple[list[int], list[int]] | None = None


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    """Everything the runner needs for one step.

    ``finished_req_ids`` lists requests finished, aborted or preempted since
    the previous step; the runner drops any per-request state it holds. An
    output with nothing scheduled is never run, so its ids come again in the
    next one. ``num_steps`` > 1 (multi-step, every request decoding one token):
    the runner runs that many steps back to back, each request's next step taking
    in the token its step before sampled, at the next position; the slots for all
    of them are in each request's ``block_ids``.

    Structured outputs: ``grammar_bitmask`` holds one row per id in
    ``structured_output_req_ids`` (requests that sample this step under a grammar;
    never in a multi-step output), each ceil(vocab / 32) int32 words, bit ``t % 32`` of
    word ``t // 32`` set when token ``t`` may come next (xgrammar's layout). Every rank
    masks the same tokens. The engine fills it before the step is sent, or, with
    ``grammar_follows`` (an executor that can: `Executor.supports_grammar_overlap`),
    while the ranks run the step's forward: it then comes as the next broadcast message,
    which each rank reads just before it samples (`ModelRunner.grammar_source`).
    """

    scheduled: list[ScheduledRequest]
    finished_req_ids: list[str]
    num_batched_tokens: int
    num_steps: int = 1
    structured_output_req_ids: list[str] = []
    grammar_bitmask: bytes | None = None
    grammar_follows: bool = False


class ModelRunnerOutput(msgspec.Struct, array_like=True, gc=False):
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
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]], list[int]]] = {}
    later_token_ids: list[list[int]] = []
    later_logprobs: list[list[dict[int, float] | None]] = []
