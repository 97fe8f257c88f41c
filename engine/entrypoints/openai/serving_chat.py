"""`POST /v1/chat/completions`: messages rendered with the model's chat template, the
assistant's reply out, whole or streamed as server-sent events (role first, then
content deltas, then the finish reason)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.logprobs import chat_logprobs
from engine.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    dump,
)
from engine.entrypoints.openai.serving import OpenAIServing, include_usage, text_delta, usage
from engine.entrypoints.openai.sse import StreamState, event_stream_response
from engine.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler. Raises APIError (see `OpenAIServing`); a model
    without a chat template, or a template that fails to render, is a 400."""

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_request(body)
        prompt_ids = self._prompt_ids(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = requested if requested is not None else max(1, self.engine.max_model_len - len(prompt_ids))
        stream, request_id, created = await self.start(body, prompt_ids, max_tokens, top_logprobs, "messages",
                                                       "chatcmpl")
        top = top_logprobs or 0

        if not body.stream:
            def whole(final: RequestOutput) -> ChatCompletionResponse:
                choice = ChatCompletionChoice(
                    message=ChatResponseMessage(content=final.text), finish_reason=final.finish_reason,
                    logprobs=chat_logprobs(self.tokenizer, final, 0, len(final.token_ids), top)
                    if body.logprobs else None)
                return ChatCompletionResponse(id=request_id, created=created, model=self.model_name,
                                              choices=[choice], usage=usage(final))

            return await self.full_response(stream, request, whole)

        with_usage = include_usage(body.stream_options)

        def chunk(choices: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None) -> Any:
            return dump(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                     choices=choices, usage=usage_info))

        def chunks(output: RequestOutput, state: StreamState) -> list[Any]:
            payloads: list[Any] = []
            if not state.started:
                payloads.append(chunk([ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant", content=""))]))
                state.started = True
            delta = text_delta(output, state.text)
            num_tokens = len(output.token_ids)
            if delta or (body.logprobs and num_tokens > state.num_tokens):
                payloads.append(chunk([ChatCompletionStreamChoice(
                    delta=DeltaMessage(content=delta),
                    logprobs=chat_logprobs(self.tokenizer, output, state.num_tokens, num_tokens, top)
                    if body.logprobs else None)]))
                state.text, state.num_tokens = state.text + delta, num_tokens
            if output.finished:
                payloads.append(chunk([ChatCompletionStreamChoice(delta=DeltaMessage(),
                                                                  finish_reason=output.finish_reason)]))
                if with_usage:
                    payloads.append(chunk([], usage(output)))
            return payloads

        return event_stream_response(stream, self.engine, chunks)

    def _prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise APIError(400, f"model `{self.model_name}` has no chat template; use /v1/completions",
                           param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors (jinja or raise_exception) are the caller's
            raise APIError(400, f"cannot render the chat template: {e}", param="messages") from None
        return tokenizer.encode(prompt_text, add_special_tokens=False)  # the template renders BOS itself
