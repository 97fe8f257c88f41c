"""Engine-side request state, mutated only by the scheduler."""

from __future__ import annotations

import enum

from engine.sampling_params import SamplingParams


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

    ``num_computed_tokens`` counts the leading tokens of :attr:`all_token_ids`
    whose KV is in the cache; ``block_ids`` is the block table covering them
    (plus any slots allocated for the step in flight), of which the first
    ``num_cached_blocks`` have been offered to the prefix cache; ``block_hashes``
    memoises the hashes of its full blocks (tokens never change, so they stay
    valid across preemption). ``arrival_index`` orders
    requests for FCFS and preemption priority (higher = later = lower priority).
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
        self.block_ids: list[int] = []
        self.num_cached_blocks: int = 0
        self.block_hashes: list[bytes] = []
        self.num_preemptions: int = 0

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
