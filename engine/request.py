"""Engine-side request state, mutated only by the scheduler."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from config import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputRequest


class RequestStatus(enum.Enum):
    """Lifecycle of a request inside the scheduler."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the three terminal states."""
        return status in _FINISH_REASONS

    @property
    def finished(self) -> bool:
        """Instance shorthand for :meth:`is_finished`."""
        return self in _FINISH_REASONS


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request as the engine tracks it.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache or
    is computed by a step already scheduled (the scheduler advances it when it
    schedules); ``num_output_placeholders`` counts the tokens those steps will
    sample that have not come back yet (0 unless steps are scheduled ahead: async
    scheduling). ``block_ids`` is the block table covering them, of which the first
    ``num_cached_blocks`` have been offered to the prefix cache; ``block_hashes``
    memoises the hashes of its full blocks (tokens never change, so they stay
    valid across preemption). ``arrival_index`` orders
    requests for FCFS and preemption priority (higher = later = lower priority).
    ``structured_output_request`` is this sample's grammar matcher when its params
    carry ``structured_outputs`` (set by `EngineCore.add_request`), else None.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_index: int = 0,
    ) -> None:
        self.request_id: str = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params: SamplingParams = sampling_params
        self.arrival_index: int = arrival_index
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        self.status: RequestStatus = RequestStatus.WAITING
        self.num_computed_tokens: int = 0
        self.num_output_placeholders: int = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks: int = 0
        self.block_hashes: list[bytes] = []
        self.num_preemptions: int = 0
        self.num_cached_tokens: int = -1  # prompt tokens the prefix cache gave at first schedule (-1: not yet)
        self.cumulative_logprob: float = 0.0  # of the sampled tokens, when logprobs are computed
        # Per prompt position (index 0 has none), filled as prefill chunks come back.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        self.prompt_logprob_ranks: list[int | None] = [None]
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # Prefix caching: `cache_salt` keeps a tenant's blocks apart; the samples of one
        # prompt (`sibling_group`, the parent request's id) share theirs even when the
        # cache is off.
        self.cache_salt: str | None = None
        self.sibling_group: str | None = None
        self.structured_output_request: StructuredOutputRequest | None = None

    def append_output(self, token: int, logprobs: dict[int, float] | None) -> None:
        """Record one sampled token (and its logprobs, if the request asked)."""
        self.output_token_ids.append(token)
        if logprobs is not None and self.sampling_params.logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token]

    def add_prompt_logprobs(self, position: int, entries: list[dict[int, float]], ranks: list[int]) -> None:
        """Prompt logprobs for positions ``position...``; positions already known (a
        preempted request recomputes its prompt) are kept as they are."""
        if self.prompt_logprobs is None:
            return
        for i, (entry, rank) in enumerate(zip(entries, ranks)):
            if position + i == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)
                self.prompt_logprob_ranks.append(rank)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a fresh list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Total known tokens: prompt plus outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"``, or ``None`` while unfinished."""
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, outputs={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
