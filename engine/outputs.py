"""What the client sees of a request. The per-step messages between the scheduler and
the workers are in `worker/outputs.py`, low enough for every layer to import them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """What the client sees for a request (cumulative, not a delta)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
