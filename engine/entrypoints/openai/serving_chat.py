"""`POST /v1/chat/completions`: messages rendered with the model's chat template, `n`
replies of the assistant out, whole or streamed as server-sent events (per choice: the
role first, then content deltas, then the finish reason).

Tools and reasoning (vLLM 0.32's behaviour): `tools` reach the template; tool_choice
"auto" needs `--enable-auto-tool-choice` and `--tool-call-parser` and parses calls out
of the answer; "required" and a named function constrain the output with a JSON
schema (tool_choice.py) and read it directly. With `--reasoning-parser` the thinking
goes to `reasoning` and tools are parsed from the answer after it (chat_output.py).
`finish_reason` is "tool_calls" when "auto" or "required" made calls and the output
stopped on its own; a named function keeps the output's reason, as OpenAI answers.

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

from config import StructuredOutputsParams
from engine.entrypoints.openai.chat_messages import template_messages
from engine.entrypoints.openai.chat_output import ChoiceOutputParser
from engine.entrypoints.openai.api_error import APIError
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
from engine.entrypoints.openai.protocol_tools import FunctionDefinition, ToolRequestError, resolve_tools
from engine.entrypoints.openai.serving import OpenAIServing, include_usage, merge_streams, text_delta, usage
from engine.entrypoints.openai.serving_completion import trim_logprobs
from engine.entrypoints.openai.sse import StreamState, event_stream_response
from engine.entrypoints.openai.tool_choice import named_function, tool_choice_constraint
from engine.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from engine.entrypoints.openai.tool_parsers.constrained_tool_parsers import NamedToolParser, RequiredToolParser
from engine.outputs import RequestOutput
from engine.reasoning import ReasoningParser, ReasoningParserManager
from engine.tokenizer import Tokenizer

ROLE = "assistant"
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def tool_finish_reason(choice: str, called: bool, finish_reason: str | None) -> str | None:
    """vLLM's finish reason: "tool_calls" when "auto" or "required" made calls and the
    output ended on its own ("stop"); otherwise the output's (a named function's too)."""
    if called and finish_reason == "stop" and choice in ("auto", "required"):
        return "tool_calls"
    return finish_reason


def grammar_after_reasoning(constraint: StructuredOutputsParams, parser: ReasoningParser) -> bool:
    """Whether the engine can apply ``constraint`` only once the thinking has ended, so
    the output still has its thinking first: when the end of thinking is one token, the
    constraint's ``reasoning_end_token_ids`` tell the engine (set here); otherwise the
    grammar constrains from the first token and the output has no thinking to split."""
    ids = parser.reasoning_end_token_ids()
    if not ids:
        return False
    constraint.reasoning_end_token_ids = ids
    return True


class OpenAIServingChat(OpenAIServing):
    """The chat completions handler. Raises APIError (see `OpenAIServing`); a model
    without a chat template, or a template that fails to render, is a 400, and so are
    malformed tools and a tool choice the server cannot honour (naming the field).
    ``tool_parser`` and ``reasoning_parser`` are registered names (checked at start-up)."""

    def __init__(self, *args: Any, enable_auto_tools: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser_cls = ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        self.reasoning_parser_cls = (ReasoningParserManager.get_reasoning_parser(reasoning_parser)
                                     if reasoning_parser else None)

    def _tools(self, body: ChatCompletionRequest) -> tuple[list[FunctionDefinition], str]:
        try:
            functions, choice = resolve_tools(body.tools, body.tool_choice)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        if choice == "auto" and not (self.enable_auto_tools and self.tool_parser_cls is not None):
            raise APIError(400, AUTO_NEEDS_FLAGS, param="tool_choice")
        return functions, choice

    def _new_tool_parser(self, choice: str) -> ToolParser | None:
        name = named_function(choice)
        if name is not None:
            return NamedToolParser(name)
        if choice == "required":
            return RequiredToolParser()
        if choice == "auto" and self.tool_parser_cls is not None:
            return self.tool_parser_cls(self.tokenizer)
        return None

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_request(body)
        functions, tool_choice = self._tools(body)
        probe = self._new_tool_parser(tool_choice)
        if probe is not None:
            probe.adjust_request(body)
        prompt_ids = self._prompt_ids(body, body.tools if functions else None)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        room = max(1, self.engine.max_model_len - len(prompt_ids))
        max_tokens = requested if requested is not None else min(self.default_max_tokens() or room, room)
        params = self.sampling_params(body, max_tokens, top_logprobs, body.prompt_logprobs)
        try:
            constraint = tool_choice_constraint(functions, tool_choice, body.parallel_tool_calls, probe)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        if constraint is not None:
            params.structured_outputs = constraint  # the tool choice's schema wins, as in vLLM
        thinking = self._thinking(body, prompt_ids, params.structured_outputs)

        def choice_parser() -> ChoiceOutputParser:
            reasoning = (self.reasoning_parser_cls(self.tokenizer, body.chat_template_kwargs)
                         if thinking and self.reasoning_parser_cls is not None else None)
            return ChoiceOutputParser(reasoning, self._new_tool_parser(tool_choice), body.include_reasoning,
                                      None if body.parallel_tool_calls else 1)

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

        with_cached = self.enable_prompt_tokens_details
        if not body.stream:
            def whole(finals: list[RequestOutput]) -> ChatCompletionResponse:
                (final,) = finals
                choices = []
                for sample in final.outputs:
                    parts = choice_parser().whole(sample.text)
                    content = echoed + parts.content if parts.content is not None else (echoed or None)
                    choices.append(ChatCompletionChoice(
                        index=sample.index,
                        message=ChatResponseMessage(content=content, reasoning=parts.reasoning,
                                                    tool_calls=parts.tool_calls),
                        finish_reason=tool_finish_reason(tool_choice, bool(parts.tool_calls), sample.finish_reason),
                        stop_reason=sample.stop_reason,
                        logprobs=chat_logprobs(text_of, sample.token_ids, sample.logprobs, 0, len(sample.token_ids),
                                               top) if body.logprobs else None,
                        token_ids=list(sample.token_ids) if body.return_token_ids else None))
                return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                              usage=usage([len(prompt_ids)], [final], with_cached),
                                              **prompt_extras(final))

            return await self.full_response([stream], request, whole)

        final_usage, every_chunk_usage = include_usage(body.stream_options)
        latest: list[RequestOutput] = []
        parsers: dict[int, ChoiceOutputParser] = {}

        def chunk(choices: list[ChatCompletionStreamChoice], usage_info: UsageInfo | None = None,
                  **extras: Any) -> Any:
            return dump(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                     choices=choices, usage=usage_info, **extras))

        def chunks(_: int, output: RequestOutput, state: StreamState) -> list[Any]:
            latest[:] = [output]
            running_usage = usage([len(prompt_ids)], [output], with_cached) if every_chunk_usage else None
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
                parser = parsers.setdefault(sample.index, choice_parser())
                parts = parser.delta(choice.text + delta, sample.finished)
                plain = parser.reasoning_parser is None and parser.tool_parser is None
                num_tokens = len(sample.token_ids)
                if (delta if plain else parts) or (body.logprobs and num_tokens > choice.num_tokens) or (
                        body.return_token_ids and num_tokens > choice.num_tokens):
                    payloads.append(chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(content=delta if plain else parts.content,
                                                               reasoning=parts.reasoning,
                                                               tool_calls=parts.tool_calls or None),
                        logprobs=chat_logprobs(text_of, sample.token_ids, sample.logprobs, choice.num_tokens,
                                               num_tokens, top) if body.logprobs else None,
                        token_ids=list(sample.token_ids[choice.num_tokens:num_tokens])
                        if body.return_token_ids else None)], running_usage))
                    choice.text, choice.num_tokens = choice.text + delta, num_tokens
                if sample.finished and not choice.finished:
                    choice.finished = True
                    payloads.append(chunk([ChatCompletionStreamChoice(
                        index=sample.index, delta=DeltaMessage(),
                        finish_reason=tool_finish_reason(tool_choice, parser.called_tools, sample.finish_reason),
                        stop_reason=sample.stop_reason)], running_usage))
            return payloads

        def final_chunks() -> list[Any]:
            return [chunk([], usage([len(prompt_ids)], latest, with_cached))] if final_usage and latest else []

        return event_stream_response(merge_streams([stream]), lambda: self.abort([stream]), chunks, final_chunks)

    def _thinking(self, body: ChatCompletionRequest, prompt_ids: list[int],
                  constraint: StructuredOutputsParams | None) -> bool:
        """Whether this request's outputs start with thinking to split off: a reasoning
        parser is set, the prompt has not closed the thinking already, and any grammar
        waits for the thinking to end."""
        if self.reasoning_parser_cls is None or self.tokenizer is None:
            return False
        parser = self.reasoning_parser_cls(self.tokenizer, body.chat_template_kwargs)
        if parser.prompt_ends_reasoning(self.tokenizer.decode(prompt_ids, skip_special_tokens=False)):
            return False
        return constraint is None or grammar_after_reasoning(constraint, parser)

    def _prompt_ids(self, body: ChatCompletionRequest, tools: list[Any] | None) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise APIError(400, f"model `{self.model_name}` has no chat template; use /v1/completions",
                           param="messages")
        try:
            messages = template_messages(body.messages)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return render_chat_prompt(self.tokenizer, messages, add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message,
                                  template_kwargs=body.chat_template_kwargs,
                                  add_special_tokens=body.add_special_tokens, tools=tools)


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                       continue_final_message: bool, template_kwargs: dict[str, Any] | None,
                       add_special_tokens: bool, tools: list[Any] | None = None) -> list[int]:
    """The token ids of ``messages`` rendered with the tokenizer's chat template, as the
    chat route and /tokenize both render them. ``continue_final_message`` renders
    without a generation prompt and cuts the text right after the final message's
    (stripped) content, as transformers does, so the model continues that message.
    ``add_special_tokens`` is normally false: the template renders BOS itself. A
    template that fails, or a final message the template does not render as it is,
    is a 400. ``tools`` (the request's) is the template's ``tools`` variable."""
    reserved = sorted({"messages", "add_generation_prompt", *(["tools"] if tools else [])} & set(template_kwargs or {}))
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {reserved}: they are request fields of their own",
                       param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt and not continue_final_message, tools=tools,
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
