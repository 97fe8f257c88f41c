"""`POST /v1/completions`: one prompt (text or token ids) in, its completion out, whole
or streamed as server-sent events."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.logprobs import TextOffsets, completion_logprobs
from engine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionPrompt,
    CompletionRequest,
    CompletionResponse,
    dump,
)
from engine.entrypoints.openai.serving import OpenAIServing, include_usage, text_delta, usage
from engine.entrypoints.openai.sse import StreamState, event_stream_response
from engine.outputs import RequestOutput

DEFAULT_MAX_TOKENS = 16  # OpenAI's


def stream_chunks(output: RequestOutput, state: StreamState,
                  response: Callable[[list[CompletionChoice], RequestOutput | None], CompletionResponse],
                  logprobs_tokenizer: Any | None, with_usage: bool) -> list[Any]:
    """The SSE payloads for one (cumulative) output of a streamed completion; advances
    `state`. One chunk per output that brings new tokens, even when they add no text
    yet (a split UTF-8 character is held back until it is whole), as vLLM streams:
    clients time tokens by chunk. `logprobs_tokenizer`: the tokenizer when the request
    asked for logprobs, else None."""
    delta = text_delta(output, state.text)
    num_tokens = len(output.token_ids)
    payloads: list[Any] = []
    if delta or output.finished or num_tokens > state.num_tokens:
        if logprobs_tokenizer is not None and state.text_offsets is None:
            state.text_offsets = TextOffsets(logprobs_tokenizer)
        offsets = state.text_offsets
        logprobs = (completion_logprobs(logprobs_tokenizer, output, state.num_tokens, num_tokens, offsets)
                    if offsets is not None else None)
        choice = CompletionChoice(text=delta, finish_reason=output.finish_reason if output.finished else None,
                                  logprobs=logprobs)
        payloads.append(dump(response([choice], None)))
        state.text, state.num_tokens = state.text + delta, num_tokens
    if output.finished and with_usage:
        payloads.append(dump(response([], output)))
    return payloads


class OpenAIServingCompletion(OpenAIServing):
    """The completions handler. Raises APIError (see `OpenAIServing`)."""

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        self.check_request(body)
        prompt_ids = self._prompt_ids(body.prompt)
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        stream, request_id, created = await self.start(body, prompt_ids, max_tokens, body.logprobs, "prompt", "cmpl")
        want_logprobs = body.logprobs is not None

        def response(choices: list[CompletionChoice], output: RequestOutput | None = None) -> CompletionResponse:
            return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=usage(output) if output is not None else None)

        if not body.stream:
            def whole(final: RequestOutput) -> CompletionResponse:
                logprobs = (completion_logprobs(self.tokenizer, final, 0, len(final.token_ids),
                                                TextOffsets(self.tokenizer)) if want_logprobs else None)
                return response([CompletionChoice(text=final.text, finish_reason=final.finish_reason,
                                                  logprobs=logprobs)], final)

            return await self.full_response(stream, request, whole)

        with_usage = include_usage(body.stream_options)

        def chunks(output: RequestOutput, state: StreamState) -> list[Any]:
            return stream_chunks(output, state, response, self.tokenizer if want_logprobs else None, with_usage)

        return event_stream_response(stream, self.engine, chunks)

    def _prompt_ids(self, prompt: CompletionPrompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"batched prompts are not supported: got {len(prompt)}, send one per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send the prompt as token ids", param="prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)
