"""`POST /v1/chat/completions`: messages rendered with the model's chat template, `n`
replies of the assistant out, whole or streamed as server-sent events (per choice: the
role first, then content deltas, then the finish reason).

`continue_final_message` renders the conversation without a generation prompt and
ends it right after the last message's text, so the model continues that message;
`echo` starts the reply with the last message's text when it is the assistant's, as
vLLM does.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.logprobs import TokenText, chat_logprobs, vllm_prompt_logprobs
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
from engine.entrypoints.openai.serving import OpenAIServing, include_usage, merge_streams, text_delta, usage
from engine.entrypoints.openai.serving_completion import trim_logprobs
from engine.entrypoints.openai.sse import StreamState, event_stream_response
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer

ROLE = "assistant"


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
        room = max(1, self.engine.max_model_len - len(prompt_ids))
        max_tokens = requested if requested is not None else min(self.default_max_tokens() or room, room)
        params = self.sampling_params(body, max_tokens, top_logprobs, body.prompt_logprobs)
        request_id = self.request_id(body, "chatcmpl")
        stream, prompt_ids = await self.submit(body, prompt_ids, params, "messages", request_id)
        created = int(time.time())
        text_of = TokenText(self.tokenizer, body.return_tokens_as_token_ids)
        top = top_logprobs or 0
        last = body.messages[-1]
        echoed = last.text() if body.echo and last.role == ROLE else ""

        def prompt_extras(output: RequestOutput) -> dict[str, Any]:
            shown: dict[str, Any] = {}
            if body.prompt_logprobs is not None and output.prompt_logprobs is not None:
                entries = [trim_logprobs(e, body.prompt_logprobs, t) for e, t in zip(output.prompt_logprobs,
                                                                                      prompt_ids)]
                shown["prompt_logprobs"] = vllm_prompt_logprobs(text_of, prompt_ids, entries,
                                                                output.prompt_logprob_ranks or [])
            if body.return_token_ids:
                shown["prompt_token_ids"] = list(prompt_ids)
            return shown

        if not body.stream:
            def whole(finals: list[RequestOutput]) -> ChatCompletionResponse:
                (final,) = finals
                choices = [ChatCompletionChoice(
                    index=sample.index, message=ChatResponseMessage(content=echoed + sample.text),
                    finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                    logprobs=chat_logprobs(text_of, sample.token_ids, sample.logprobs, 0, len(sample.token_ids), top)
                    if body.logprobs else None,
                    token_ids=list(sample.token_ids) if body.return_token_ids else None,
                ) for sample in final.outputs]
                return ChatCompletionResponse(id=request_id, created=created, model=self.model_name,
                                              choices=choices, usage=usage([len(prompt_ids)], [final]),
                                              **prompt_extras(final))

            return await self.full_response([stream], request, whole)

        final_usage, every_chunk_usage = include_usage(body.stream_options)
        latest: list[RequestOutput] = []

        def chunk(choices: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None,
                  **extras: Any) -> Any:
            return dump(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                     choices=choices, usage=usage_info, **extras))

        def chunks(_: int, output: RequestOutput, state: StreamState) -> list[Any]:
            latest[:] = [output]
            running_usage = usage([len(prompt_ids)], [output]) if every_chunk_usage else None
            payloads: list[Any] = []
            for sample in output.outputs:
                choice = state.choice(sample.index)
                if not choice.started:
                    extras = prompt_extras(output) if sample.index == 0 else {}
                    payloads.append(chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(role=ROLE, content=""))], running_usage, **extras))
                    choice.started = True
                    if echoed:
                        payloads.append(chunk([ChatCompletionStreamChoice(
                            index=sample.index, delta=DeltaMessage(content=echoed))], running_usage))
                delta = text_delta(sample.text, sample.finished, choice.text)
                num_tokens = len(sample.token_ids)
                if delta or (body.logprobs and num_tokens > choice.num_tokens) or (
                        body.return_token_ids and num_tokens > choice.num_tokens):
                    payloads.append(chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(content=delta),
                        logprobs=chat_logprobs(text_of, sample.token_ids, sample.logprobs, choice.num_tokens,
                                               num_tokens, top) if body.logprobs else None,
                        token_ids=list(sample.token_ids[choice.num_tokens:num_tokens])
                        if body.return_token_ids else None)], running_usage))
                    choice.text, choice.num_tokens = choice.text + delta, num_tokens
                if sample.finished and not choice.finished:
                    choice.finished = True
                    payloads.append(chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(), finish_reason=sample.finish_reason,
                        stop_reason=sample.stop_reason)], running_usage))
            return payloads

        def final_chunks() -> list[Any]:
            return [chunk([], usage([len(prompt_ids)], latest))] if final_usage and latest else []

        return event_stream_response(merge_streams([stream]), lambda: self.abort([stream]), chunks, final_chunks)

    def _prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise APIError(400, f"model `{self.model_name}` has no chat template; use /v1/completions",
                           param="messages")
        messages = []
        for i, m in enumerate(body.messages):
            try:
                messages.append({"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})})
            except ValueError as e:
                raise APIError(400, str(e), param=f"messages[{i}].content") from None
        return render_chat_prompt(self.tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message,
                                  template_kwargs=body.chat_template_kwargs,
                                  add_special_tokens=body.add_special_tokens)


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                       continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                       add_special_tokens: bool) -> list[int]:
    """The token ids of ``messages`` rendered with the tokenizer's chat template, as the
    chat route and /tokenize both render them. ``continue_final_message`` renders
    without a generation prompt and cuts the text right after the final message's
    (stripped) content, as transformers does, so the model continues that message.
    ``add_special_tokens`` is normally false: the template renders BOS itself. A
    template that fails, or a final message the template does not render as it is,
    is a 400."""
    reserved = sorted({"messages", "add_generation_prompt"} & set(template_kwargs or {}))
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {reserved}: they are request fields of their own",
                       param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
            **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - template errors (jinja or raise_exception) are the caller's
        raise APIError(400, f"cannot render the chat template: {e}", param="messages") from None
    if continue_final_message:
        final = str(messages[-1].get("content") or "").strip()
        cut = text.rfind(final) if final else -1
        if cut < 0:
            raise APIError(400, "continue_final_message: the final message's content is not in the rendered "
                                "chat template", param="continue_final_message")
        text = text[:cut + len(final)]
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
