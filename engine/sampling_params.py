"""Per-request generation settings, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    Contract:
      * ``temperature == 0`` (or ``top_k == 1``) means greedy decoding.
      * ``top_k`` of ``0`` or ``-1`` disables top-k filtering.
      * ``seed`` fixes the request's random stream; ``None`` derives it from the
        engine seed and the request id.
      * ``logprobs=N`` returns the top-N logprobs (plus the sampled token's) per
        generated token; ``0`` returns only the sampled token's; ``None`` none.
      * Every field is checked in ``__post_init__``; a bad value raises
        ``ValueError`` naming the field, the value and the allowed range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # bool is a subclass of int; reject it where a count is meant so that
        # `max_tokens=True` does not silently mean 1.
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                "stop_token_ids must be a list of integers >= 0, "
                f"got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(
                f"logprobs must be None or an integer >= 0, got {self.logprobs!r}"
            )

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
