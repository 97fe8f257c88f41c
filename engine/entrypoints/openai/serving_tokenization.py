"""`POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.

/tokenize takes either `{"model", "prompt", "add_special_tokens": true}` (a text
prompt, encoded as /v1/completions encodes it) or `{"model", "messages",
"add_generation_prompt": true, "continue_final_message": false, "add_special_tokens":
false, "tools"}` (rendered with the chat template, as /v1/chat/completions renders it:
the same messages, with tool calls and results, and the same checked `tools`), and
answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with
`"return_token_strs": true`). /detokenize takes `{"model", "tokens"}` and answers
`{"prompt"}` (special tokens kept, as vLLM decodes it). `chat_template_kwargs` are
extra template variables, as in the chat route.

The request models are strict: an unknown field or a wrong type is a 400 naming the
field; an explicit null means the field's default. What vLLM accepts but this server
cannot honour here (a request's own `chat_template`, which vLLM too refuses without
--trust-request-chat-template, `mm_processor_kwargs`, `media_io_kwargs`) is a 400
naming it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from engine.async_engine import AsyncEngine
from engine.entrypoints.openai.api_error import APIError
from engine.entrypoints.openai.chat_messages import template_messages
from engine.entrypoints.openai.protocol import ChatMessage
from engine.entrypoints.openai.protocol_tools import ToolRequestError, resolve_tools
from engine.entrypoints.openai.serving_chat import render_chat_prompt


class _StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_StrictRequest):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool | None = None  # None: True (BOS as the tokenizer adds it)
    return_token_strs: StrictBool | None = None


class TokenizeChatRequest(_StrictRequest):
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool | None = None  # None: True
    continue_final_message: StrictBool | None = None  # None: False
    add_special_tokens: StrictBool | None = None  # None: False (the template renders BOS)
    return_token_strs: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # checked as the chat route checks them
    # vLLM's, refused here when set (see the module docstring):
    chat_template: StrictStr | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_StrictRequest):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def _parse(model: type[BaseModel], body: Any) -> Any:
    """`body` validated as `model`; a failure is raised as FastAPI's validation error,
    so that it renders as the other routes' 400s (errors.py) and names the field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as e:
        raise APIError(400, f"the request body is not JSON: {e}") from None


class OpenAIServingTokenization:
    """The /tokenize and /detokenize handlers of one engine, served as `model_names`
    (the first is the main name; any may be named in a request)."""

    def __init__(self, engine: AsyncEngine, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, f"model `{self.model_names[0]}` has no tokenizer; only token ids can be served")
        return tokenizer

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_names[0]}`",
                           param="model", code="model_not_found")

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        parsed = _parse(TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest, body)
        self._check_model(parsed.model)
        tokenizer = self.tokenizer
        if isinstance(parsed, TokenizeChatRequest):
            ids = self._chat_ids(parsed, tokenizer)
        else:
            add_special = True if parsed.add_special_tokens is None else parsed.add_special_tokens
            ids = tokenizer.encode(parsed.prompt, add_special_tokens=add_special)
        strs = tokenizer.convert_ids_to_tokens(ids) if parsed.return_token_strs else None
        response = TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                    token_strs=strs)
        return JSONResponse(response.model_dump())

    @staticmethod
    def _chat_ids(body: TokenizeChatRequest, tokenizer: Any) -> list[int]:
        for name in ("chat_template", "mm_processor_kwargs", "media_io_kwargs"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported by /tokenize on this server", param=name)
        continue_final = bool(body.continue_final_message)
        add_generation = (not continue_final) if body.add_generation_prompt is None else body.add_generation_prompt
        if continue_final and add_generation:
            raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           param="continue_final_message")
        if tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template; tokenize a prompt instead", param="messages")
        try:
            functions, _ = resolve_tools(body.tools, None)
            messages = template_messages(body.messages)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        return render_chat_prompt(tokenizer, messages, add_generation_prompt=add_generation,
                                  continue_final_message=continue_final, template_kwargs=body.chat_template_kwargs,
                                  add_special_tokens=bool(body.add_special_tokens),
                                  tools=body.tools if functions else None)

    async def detokenize(self, request: Request) -> JSONResponse:
        parsed = _parse(DetokenizeRequest, await _json_body(request))
        self._check_model(parsed.model)
        tokenizer = self.tokenizer
        vocab = tokenizer.vocab_size
        bad = [t for t in parsed.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        text = tokenizer.decode(parsed.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
