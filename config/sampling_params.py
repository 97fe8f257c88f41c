"""Per-request generation settings, validated once at construction."""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field

from config.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

_MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MIN_TEMPERATURE = 0.01  # vLLM's: smaller positive temperatures are raised to it


class RequestOutputKind(enum.Enum):
    """Which outputs a request gives (vLLM's): ``CUMULATIVE``, one per step that
    advanced it, each with everything so far; ``DELTA``, one per such step, each with
    only the tokens, text and logprobs that are new (the prompt's logprobs come in the
    first); ``FINAL_ONLY``, one, when it finishes (what `EngineCore.generate` asks
    for: its text is then decoded once, at the end, unless stop strings need it on
    the way)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops (vLLM's names and meanings).

    Contract:
      * ``temperature == 0`` (or ``top_k == 1``) means greedy decoding: the argmax of
        the logits after the processors below; a positive temperature below 0.01 is
        raised to 0.01, as vLLM does.
      * The logits of each step go through, in this order: ``allowed_token_ids``
        (every other id masked), ``bad_words`` (the last token of a word whose other
        tokens the output just produced is masked), ``min_tokens`` (EOS and
        ``stop_token_ids`` masked until that many tokens exist), ``logit_bias``
        (added), ``repetition_penalty`` (over prompt and output tokens, as
        transformers: positive logits divided, negative multiplied), then
        ``frequency_penalty`` and ``presence_penalty`` (over output tokens, as
        OpenAI). Sampling then applies temperature, top-k, top-p and ``min_p``
        (a token below ``min_p`` times the likeliest token's probability is dropped).
      * ``top_k`` of ``0`` or ``-1`` disables top-k filtering.
      * ``seed`` fixes the request's random stream; ``None`` derives it from the
        engine seed and the request id. Sample ``i`` of ``n`` uses ``seed + i``.
      * ``n`` samples are returned; ``best_of`` (>= n) are generated and the ``n``
        with the highest cumulative logprob kept.
      * ``stop`` strings end the request when the text contains one; the text ends
        before it unless ``include_stop_str_in_output``. ``stop_token_ids`` end it
        when one is sampled (the token stays in the output).
      * ``logprobs=N`` returns the top-N logprobs (plus the sampled token's) per
        generated token; ``0`` returns only the sampled token's; ``None`` none. They
        are the model's raw distribution, before any processor. ``prompt_logprobs=N``
        does the same for every prompt token after the first.
      * ``detokenize=False`` gives token ids only (the text stays empty), and
        so cannot be used with ``stop`` strings.
      * ``output_kind`` (a `RequestOutputKind`) says which outputs the request gives.
      * ``max_tokens=0`` is allowed only with ``prompt_logprobs`` (scoring a prompt).
      * ``truncate_prompt_tokens=K`` keeps the last K prompt tokens (the first K with
        ``truncation_side="right"``); ``-1`` keeps up to max_model_len - 1.
      * ``structured_outputs`` (a `StructuredOutputsParams`, or its dict) constrains the
        output to a JSON schema, regex, choice list or grammar: tokens that cannot
        continue a match are masked before any other processor.
      * Every field is checked in ``__post_init__``; a bad value raises
        ``ValueError`` naming the field, the value and the allowed range.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    #: Token ids of each bad word, filled by the engine from ``bad_words`` (with its tokenizer).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    #: What ``min_tokens`` holds back: ``stop_token_ids`` plus the model's EOS ids (the engine adds those).
    all_stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # bool is a subclass of int; reject it where a count is meant so that
        # `max_tokens=True` does not silently mean 1.
        _int_at_least("n", self.n, 1)
        if self.best_of is not None:
            _int_at_least("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n={self.n}, got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # As vLLM: below this, logits / temperature overflow float32; greedy is 0.
            logger.warning("temperature %g is below %g; using %g (temperature 0 is greedy)",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _int_at_least("top_k", self.top_k, -1, "(0 or -1 disables it)")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = _id_list("stop_token_ids", self.stop_token_ids)
        self.all_stop_token_ids = sorted(set(self.stop_token_ids) | set(self.all_stop_token_ids))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are found in the text, which detokenize=False does not make; "
                             "use stop_token_ids, or detokenize=True")
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.prompt_logprobs is not None:
            _int_at_least("prompt_logprobs", self.prompt_logprobs, 0)
        _int_at_least("max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1,
                      "(0 only with prompt_logprobs, to score a prompt)")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens!r}")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            if not _is_int(token) or token < 0 or not _is_finite(value):
                raise ValueError(f"logit_bias must map token ids >= 0 to finite numbers, got {token!r}: {value!r}")
            bias[token] = max(-_MAX_LOGIT_BIAS, min(_MAX_LOGIT_BIAS, float(value)))
        self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _id_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        self.bad_words = list(self.bad_words)
        if self.truncate_prompt_tokens is not None:
            _int_at_least("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, "(-1: up to max_model_len)")
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 or >= 1, got 0")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind "
                             f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """How many sequences run for the request (``best_of``, else ``n``)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_history(self) -> bool:
        """Whether the sampler must see the request's tokens (penalties, bad words)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or any(len(ids) > 1 for ids in self.bad_words_token_ids)
        )

    @property
    def processes_logits(self) -> bool:
        """Whether any processor changes the logits before sampling."""
        return (
            self.needs_history
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(value)  # type: ignore[arg-type]


def _int_at_least(name: str, value: object, minimum: int, note: str = "") -> None:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer >= {minimum}{' ' + note if note else ''}, got {value!r}")


def _id_list(name: str, value: object) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in value):
        raise ValueError(f"{name} must be a list of integers >= 0, got {value!r}")
    return list(value)
