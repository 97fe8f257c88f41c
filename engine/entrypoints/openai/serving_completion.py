"""`POST /v1/completions`: one prompt or a list of them (text or token ids) in, `n`
completions of each out, whole or streamed as server-sent events.

Choice `i * n + j` is sample `j` of prompt `i`, as in vLLM. With `echo` a choice's
text starts with its prompt's, and with `logprobs` its logprobs start with the prompt
tokens' (the first of which has none): `echo` + `logprobs` + `max_tokens: 0` scores a
prompt, as log-likelihood evaluations ask.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.entrypoints.openai.api_error import APIError
from engine.entrypoints.openai.logprobs import TextOffsets, TokenText, completion_logprobs, vllm_prompt_logprobs
from engine.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, dump
from engine.entrypoints.openai.serving import OpenAIServing, include_usage, merge_streams, text_delta, usage
from engine.entrypoints.openai.sse import ChoiceState, StreamState, event_stream_response
from engine.outputs import CompletionOutput, RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's


def trim_logprobs(entry: dict[int, float] | None, k: int, token: int) -> dict[int, float] | None:
    """`entry` cut to its `k` likeliest plus `token`'s own."""
    if entry is None:
        return None
    kept = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])
    if token in entry:
        kept[token] = entry[token]
    return kept


class PromptState:
    """One prompt of the request as run: its ids, its text (for echo), its stream's outputs."""

    def __init__(self, ids: list[int], text: str) -> None:
        self.ids, self.text = ids, text
        self.last: RequestOutput | None = None


def chunk_choice(body: CompletionRequest, prompt: PromptState, output: RequestOutput, sample: CompletionOutput,
                 state: ChoiceState, index: int, tokenizer: Any = None, logprobs_of: Any = None,
                 extras: Any = None) -> CompletionChoice | None:
    """The chunk of one choice for this output, or None if it brings nothing: one
    chunk per output that brings new tokens, even when they add no text yet (a
    split UTF-8 character is held back until it is whole), as vLLM streams:
    clients time tokens by chunk. Advances `state`."""
    first = not state.started
    delta = text_delta(sample.text, sample.finished, state.text)
    num_tokens = len(sample.token_ids)
    ends = sample.finished and not state.finished
    if not (delta or num_tokens > state.num_tokens or ends or (first and body.echo)):
        return None
    prefix = prompt.text if first else ""
    logprobs = None
    if logprobs_of is not None:
        if state.text_offsets is None:
            state.text_offsets = TextOffsets(tokenizer)
        skip = len(prompt.ids) if body.echo else 0
        start = 0 if first else skip + state.num_tokens
        logprobs = logprobs_of(prompt, output, sample, start, skip + num_tokens, state.text_offsets)
    choice = CompletionChoice(
        index=index, text=prefix + delta, logprobs=logprobs,
        finish_reason=sample.finish_reason if sample.finished else None,
        stop_reason=sample.stop_reason if sample.finished else None,
        token_ids=list(sample.token_ids[state.num_tokens:num_tokens]) if body.return_token_ids else None,
        **(extras(prompt, output, first) if extras is not None else {}))
    state.started, state.finished = True, sample.finished
    state.text, state.num_tokens = state.text + delta, num_tokens
    return choice


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler. Raises APIError (see `OpenAIServing`)."""

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        self.check_request(body)
        prompt_ids = self._prompt_ids(body)
        max_tokens = (body.max_tokens if "max_tokens" in body.model_fields_set
                      else self.default_max_tokens() or DEFAULT_MAX_TOKENS)
        if max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)",
                           param="max_tokens")
        if body.stream and (body.best_of or body.n) > body.n:
            raise APIError(400, "best_of > n cannot be streamed: the best samples are known only at the end",
                           param="best_of")
        want_logprobs = body.logprobs is not None
        # Echoed logprobs need the prompt's; prompt scoring (max_tokens 0) computes them anyway.
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
        compute_prompt_logprobs = max(wanted) if wanted else (0 if max_tokens == 0 else None)
        params = self.sampling_params(body, max_tokens, body.logprobs, compute_prompt_logprobs)
        base_id = self.request_id(body, "cmpl")
        streams, prompts = [], []
        try:
            for i, ids in enumerate(prompt_ids):
                stream, run_ids = await self.submit(body, ids, params, "prompt",
                                                    base_id if len(prompt_ids) == 1 else f"{base_id}-{i}")
                streams.append(stream)
                prompts.append(PromptState(run_ids, self._text(run_ids) if body.echo else ""))
        except BaseException:
            self.abort(streams)
            raise
        created = int(time.time())
        text_of = TokenText(self.tokenizer, body.return_tokens_as_token_ids)

        def response(choices: list[CompletionChoice], with_usage: bool = False) -> CompletionResponse:
            finals = [p.last for p in prompts if p.last is not None]
            return CompletionResponse(id=base_id, created=created, model=self.model_name, choices=choices,
                                      usage=usage([len(p.ids) for p in prompts], finals,
                                                  self.enable_prompt_tokens_details) if with_usage else None)

        def logprobs_of(prompt: PromptState, output: RequestOutput, sample: CompletionOutput, start: int, end: int,
                        offsets: TextOffsets) -> Any:
            """Logprobs of tokens [start, end) of the choice's token list (prompt first with echo)."""
            tokens, entries = list(sample.token_ids), list(sample.logprobs or [])
            if body.echo:
                k = body.logprobs or 0
                prompt_entries = output.prompt_logprobs or [None] * len(prompt.ids)
                entries = [trim_logprobs(e, k, t) for e, t in zip(prompt_entries, prompt.ids)] + entries
                tokens = prompt.ids + tokens
            return completion_logprobs(text_of, tokens, entries, start, end, offsets)

        def extras(prompt: PromptState, output: RequestOutput, first: bool) -> dict[str, Any]:
            shown: dict[str, Any] = {}
            if first and body.prompt_logprobs is not None and output.prompt_logprobs is not None:
                entries = [trim_logprobs(e, body.prompt_logprobs, t) for e, t in zip(output.prompt_logprobs,
                                                                                      prompt.ids)]
                shown["prompt_logprobs"] = vllm_prompt_logprobs(text_of, prompt.ids, entries,
                                                                output.prompt_logprob_ranks or [])
            if first and body.return_token_ids:
                shown["prompt_token_ids"] = list(prompt.ids)
            return shown

        if not body.stream:
            def whole(finals: list[RequestOutput]) -> CompletionResponse:
                choices = []
                for i, (prompt, final) in enumerate(zip(prompts, finals)):
                    prompt.last = final
                    for sample in final.outputs:
                        num = (len(prompt.ids) if body.echo else 0) + len(sample.token_ids)
                        choices.append(CompletionChoice(
                            index=i * body.n + sample.index, text=prompt.text + sample.text,
                            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                            logprobs=logprobs_of(prompt, final, sample, 0, num, TextOffsets(self.tokenizer))
                            if want_logprobs else None,
                            token_ids=list(sample.token_ids) if body.return_token_ids else None,
                            **extras(prompt, final, True)))
                return response(choices, with_usage=True)

            return await self.full_response(streams, request, whole)

        final_usage, every_chunk_usage = include_usage(body.stream_options)

        def chunks(i: int, output: RequestOutput, state: StreamState) -> list[Any]:
            prompt = prompts[i]
            prompt.last = output
            payloads: list[Any] = []
            for sample in output.outputs:
                choice_state = state.choice(i * body.n + sample.index)
                choice = chunk_choice(body, prompt, output, sample, choice_state, i * body.n + sample.index,
                                      self.tokenizer, logprobs_of if want_logprobs else None, extras)
                if choice is not None:
                    payloads.append(dump(response([choice], with_usage=every_chunk_usage)))
            return payloads

        def final_chunks() -> list[Any]:
            return [dump(response([], with_usage=True))] if final_usage else []

        return event_stream_response(merge_streams(streams), lambda: self.abort(streams), chunks, final_chunks)

    def _text(self, ids: list[int]) -> str:
        """An echoed prompt's text: its tokens decoded, special tokens (BOS) left out, as
        the text offsets count them."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _prompt_ids(self, body: CompletionRequest) -> list[list[int]]:
        """Each prompt's token ids: a string, a list of strings, token ids, or a list of them."""
        prompt = body.prompt
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        many = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
        result = []
        for one in (prompt if many else [prompt]):  # type: ignore[union-attr]
            if isinstance(one, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
                result.append(self.tokenizer.encode(one, add_special_tokens=body.add_special_tokens))
            else:
                result.append(list(one))
        return result
