"""What the client sees of a request (vLLM's shapes). The per-step messages between the
scheduler and the workers are in `worker/outputs.py`, low enough for every layer to
import them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request (cumulative, not a delta).

    ``stop_reason`` is the stop string or stop token id that ended it (None for EOS,
    length or abort). ``cumulative_logprob`` is the sum of its tokens' logprobs when
    they were computed (logprobs requested, or best_of > n), else None."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the client sees for a request: its ``n`` samples (``outputs``, by index) and,
    when asked, its prompt's logprobs (index 0, the first token, has none; ranks give
    each prompt token's rank, 1 = likeliest). ``text``, ``token_ids``, ``logprobs`` and
    ``finish_reason`` are the first sample's, for the common n=1 caller.
    ``num_cached_tokens`` is how many prompt tokens the prefix cache supplied when the
    request was first scheduled (vLLM's name; 0 until then, and with the cache off)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = field(default=None, repr=False)
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
