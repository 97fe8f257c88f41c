"""The input processor (vLLM's `Processor`, vllm/v1/engine/processor.py): a prompt and
its SamplingParams in, a validated `EngineCoreRequest` out, or a ValueError that names
what is wrong.

Each request is processed exactly once. The server processes it on the request's own
thread (a bad request is a 400 before it is queued) and hands the engine loop the
`EngineCoreRequest`, which `EngineCore.add_request` takes as it is; a library caller
passes a plain prompt, which `EngineCore.add_request` processes itself.

The checks run in this order, and the first that fails is raised: the number of
samples; the prompt, tokenized (a string) and truncated (`truncate_prompt_tokens`);
the caller's own check of the prompt as it will run (the server's context length);
its token ids against the vocabulary (ids given by the caller); then what needs the
model: bad words and stop strings need a tokenizer, stop / allowed / biased token ids
must lie in the vocabulary, and the EOS ids join the stops; last, a structured-output
constraint is compiled (engine/structured_output/, cached by its text): one that does
not compile is a ValueError naming its field (``structured_outputs.json``, ...).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from config import EngineConfig, SamplingParams, StructuredOutputsParams
from engine.structured_output import StructuredOutputManager, normalize

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class EngineCoreRequest:
    """A request the processor validated (vLLM's name): its prompt as it runs and its
    parameters with the model's stops resolved. Built only by `Processor.process_inputs`;
    `EngineCore.add_request` queues it without checking it again. `arrival_time`
    (time.monotonic()) is when processing began, for the request's latency metrics.
    `structured_output_grammar` is the compiled grammar of `sampling_params.structured_outputs`
    (the manager's, opaque), or None."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = 0.0
    structured_output_grammar: Any = None


def eos_token_ids(tokenizer: Any, hf_config: Any) -> list[int]:
    """The model's end-of-sequence ids: the tokenizer's, else the HF config's `eos_token_id`."""
    if tokenizer is not None and tokenizer.eos_token_ids:
        return list(tokenizer.eos_token_ids)
    eos = getattr(hf_config, "eos_token_id", None)
    return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]


class Processor:
    """Validates requests for one EngineCore. Reads only immutable state (the config,
    the tokenizer, the EOS ids) and the structured-output manager, whose `compile` is
    thread-safe, so any thread may call it; it holds no request."""

    def __init__(self, config: EngineConfig, tokenizer: Any,
                 structured_output_manager: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(tokenizer, config.model_config.hf_config)
        self.structured_output_manager = structured_output_manager or StructuredOutputManager(
            config, tokenizer, self.eos_token_ids)

    def process_inputs(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        check_prompt: Callable[[list[int]], None] | None = None,
    ) -> EngineCoreRequest:
        """The request, validated in the order the module docstring gives.
        `check_prompt(ids)` runs on the prompt as it will run, before its ids and the
        sampling fields are checked against the model (the server's context-length
        400 and request log). Raises ValueError naming the field or the prompt."""
        arrival_time = time.monotonic()
        params = sampling_params or SamplingParams()
        self.check_num_samples(params)
        ids = self.truncate_prompt(self._encode(prompt) if isinstance(prompt, str) else list(prompt), params)
        if check_prompt is not None:
            check_prompt(ids)
        if not isinstance(prompt, str):
            ids = self._check_token_ids(ids)
        params = self._with_model_stops(params)
        grammar = None
        if params.structured_outputs is not None:
            params = dataclasses.replace(params, structured_outputs=normalize(params.structured_outputs))
            grammar = self.check_structured_outputs(params.structured_outputs)
        return EngineCoreRequest(request_id, ids, params, cache_salt, arrival_time, grammar)

    def check_structured_outputs(self, constraint: StructuredOutputsParams | None) -> Any:
        """The compiled grammar of ``constraint`` (None for None), compiled once per engine
        and text. Raises ValueError naming the field for one that does not compile (an
        invalid schema, regex or grammar, or a schema feature the backend cannot enforce)."""
        if constraint is None:
            return None
        return self.structured_output_manager.compile(constraint)

    def check_num_samples(self, params: SamplingParams) -> None:
        """A request runs at most max_num_seqs samples (n, or best_of): more could never
        run in one step, and a huge fan-out would hold every other request back.
        Raises ValueError naming the field."""
        limit = self.config.scheduler_config.max_num_seqs
        if params.num_samples > limit:
            name = "best_of" if params.best_of is not None else "n"
            raise ValueError(f"{name} must be at most max_num_seqs={limit} (the sequences one step runs), "
                             f"got {params.num_samples}")

    def truncate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """``prompt_ids`` cut to ``params.truncate_prompt_tokens`` (-1: max_model_len),
        keeping its end (its start with ``truncation_side="right"``)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep == -1:
            keep = self.config.scheduler_config.max_model_len
        if len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[:keep] if params.truncation_side == "right" else prompt_ids[-keep:]

    def _encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                f"prompt is a string but {self.config.model} has no tokenizer "
                "(a tokenizer.json, or one inside a GGUF); pass token ids"
            )
        return self.tokenizer.encode(prompt)

    def _check_token_ids(self, prompt: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def _with_model_stops(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what needs the model: the bad words' token ids (each word as
        is and after a space, as it reads inside a text) and the EOS ids that
        ``min_tokens`` holds back. Raises ValueError if they need a tokenizer it lacks."""
        if (params.bad_words or params.stop) and self.tokenizer is None:
            field_name = "bad_words" if params.bad_words else "stop"
            raise ValueError(f"{field_name} need a tokenizer, and {self.config.model} has none; "
                             "use stop_token_ids / logit_bias instead")
        bad_ids: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False) if self.tokenizer else []
                if ids and ids not in bad_ids:
                    bad_ids.append(ids)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        vocab = self.config.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias))):
            bad = [t for t in ids or [] if t >= vocab]
            if bad:
                raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        return dataclasses.replace(params, bad_words_token_ids=bad_ids, all_stop_token_ids=sorted(stops))
