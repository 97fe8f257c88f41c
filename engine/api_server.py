"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

`build_app(async_engine, served_model_name, api_key=None)` returns the app; `engine.serve`
runs it under uvicorn. Routes: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (models with a chat template), `GET /health` (503 once a
worker is dead) and `GET /metrics` (Prometheus text).

Every error body is OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`.
Invalid requests (pydantic validation, SamplingParams and engine ValueErrors) are 400s
and leave the server up. Streams are server-sent events ending in `data: [DONE]`; a
client that goes away (streaming or not) has its request aborted in the engine.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import AsyncEngine, RequestAbortedError, RequestStream
from engine.detokenizer import IncrementalDetokenizer
from engine.metrics import CONTENT_TYPE
from engine.outputs import RequestOutput
from engine.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage, ChatTokenLogprob,
    ChatTopLogprob, CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse, DeltaMessage,
    ErrorInfo, ErrorResponse, ModelCard, ModelList, UsageInfo, dump)
from engine.sampling_params import SamplingParams
from executor.errors import EngineDeadError

MAX_LOGPROBS = 20
_PARAM_IN_MESSAGE = re.compile(r"^(\w+) must\b")


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI-style error body."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code


def _error_response(status_code: int, message: str, type: str = "invalid_request_error",
                    param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(dump(body), status_code=status_code)


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _error_payload(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, EngineDeadError):
        info = ErrorInfo(message=str(exc), type="service_unavailable_error")
    else:
        info = ErrorInfo(message=f"{type(exc).__name__}: {exc}", type="internal_server_error")
    return dump(ErrorResponse(error=info))


class _EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so the generator's
    `finally` (which aborts the request) runs even when the send side fails first."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class _APIKeyMiddleware:
    """Require `Authorization: Bearer KEY` on every /v1 route (pure ASGI: streams untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                response = _error_response(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                                           code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """The handlers' logic, bound to one engine and one served model name."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer

    # --------------------------------------------------------------- checks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    @staticmethod
    def check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
        for param, message in body.unsupported_fields():
            raise APIError(400, message, param=param)

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                        logprobs: int | None) -> SamplingParams:
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                seed=body.seed,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
        except ValueError as e:
            match = _PARAM_IN_MESSAGE.match(str(e))
            raise APIError(400, str(e), param=match.group(1) if match else None) from None

    def check_context(self, num_prompt_tokens: int, max_tokens: int, prompt_param: str) -> None:
        max_len = self.engine.max_model_len
        if num_prompt_tokens + max_tokens > max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, {max_tokens} "
                "for the completion). Please reduce the length of the prompt or of the completion.",
                param=prompt_param,
            )

    def completion_prompt_ids(self, prompt: Any) -> list[int]:
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

    async def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                          prompt_param: str) -> RequestStream:
        try:
            return await self.engine.add_request(prompt_ids, params, request_id)
        except ValueError as e:
            raise APIError(400, str(e), param=prompt_param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="service_unavailable_error") from None

    async def collect(self, stream: RequestStream, request: Request) -> RequestOutput | None:
        """The final output, or None if the client went away first (the request is aborted)."""

        async def consume() -> RequestOutput:
            final = None
            async for output in stream:
                final = output
            assert final is not None
            return final

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            if not stream.done:
                self.engine.abort(stream.request_id)
        if not consumer.done() or consumer.cancelled():
            return None
        try:
            return consumer.result()
        except EngineDeadError as e:
            raise APIError(503, str(e), type="service_unavailable_error") from None
        except RequestAbortedError as e:
            raise APIError(500, str(e), type="internal_server_error") from None

    # ------------------------------------------------------------- logprobs

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text_offsets(self) -> TextOffsets:
        return TextOffsets(self.tokenizer)

    def completion_logprobs(
        self, output: RequestOutput, start: int, end: int, offsets: TextOffsets
    ) -> CompletionLogProbs:
        """OpenAI completions logprobs of generated tokens [start, end); text_offset is each
        token's start in the completion text, from `offsets` (one per response, asked
        for increasing token positions)."""
        result = CompletionLogProbs()
        ids = output.token_ids
        for i in range(start, end):
            entry = output.logprobs[i] if output.logprobs is not None and i < len(output.logprobs) else {}
            result.tokens.append(self.token_text(ids[i]))
            result.token_logprobs.append(entry.get(ids[i]))
            top: dict[str, float] = {}
            for t, lp in entry.items():  # distinct ids can share a text: keep the likeliest
                text = self.token_text(t)
                top[text] = max(lp, top.get(text, lp))
            result.top_logprobs.append(top)
            result.text_offset.append(offsets.before(ids, i))
        return result

    def chat_logprobs(self, output: RequestOutput, start: int, end: int, top: int) -> ChatChoiceLogprobs:
        content = []
        for i in range(start, end):
            token_id = output.token_ids[i]
            entry = output.logprobs[i] if output.logprobs is not None and i < len(output.logprobs) else {}
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            text = self.token_text(token_id)
            content.append(ChatTokenLogprob(
                token=text, logprob=entry.get(token_id, float("-inf")), bytes=list(text.encode()),
                top_logprobs=[ChatTopLogprob(token=(t := self.token_text(tid)), logprob=lp, bytes=list(t.encode()))
                              for tid, lp in best]))
        return ChatChoiceLogprobs(content=content)


def _usage(output: RequestOutput) -> UsageInfo:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _text_delta(output: RequestOutput, sent: str) -> str:
    """New text since `sent`. An unfinished text ending in U+FFFD is held back: it is
    probably a multi-byte character whose remaining bytes come with the next tokens."""
    text = output.text
    if not output.finished and text.endswith("\ufffd"):
        return ""
    return text[len(sent):]


class TextOffsets:
    """Where each generated token starts in the completion text (OpenAI `text_offset`).

    One per response, asked for increasing positions: an incremental detokenizer makes
    that O(1) decodes per token, where decoding every prefix was quadratic in the
    response length. Text held back for an unfinished multi-byte character does not
    count yet, so no offset points inside a character.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

    def before(self, token_ids: list[int], i: int) -> int:
        if self._detokenizer is None or i == 0:
            return 0
        return len(self._detokenizer.update(token_ids[:i]))


@dataclass
class _StreamState:
    """What a stream has sent so far: text, number of tokens, and any chunk at all."""

    text: str = ""
    num_tokens: int = 0
    started: bool = False
    text_offsets: TextOffsets | None = None


async def _events(stream: RequestStream, serving: OpenAIServing, make_chunks: Any) -> AsyncIterator[str]:
    """Drive one stream into SSE lines; `make_chunks(output, state)` returns the payloads for
    one output and advances `state`. Errors become an error event, then [DONE]."""
    state = _StreamState()
    try:
        async for output in stream:
            for payload in make_chunks(output, state):
                yield _sse(payload)
    except (EngineDeadError, RequestAbortedError) as e:
        yield _sse(_error_payload(e))
    finally:
        if not stream.done:
            serving.engine.abort(stream.request_id)
    yield _SSE_DONE


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` as model `served_model_name`."""
    app = FastAPI(title="tp-runtime", summary="OpenAI-compatible tensor-parallel inference server")
    serving = OpenAIServing(async_engine, served_model_name)
    metrics = async_engine.metrics
    app.state.serving = serving
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    # ------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status_code == 400:
            metrics.on_request_rejected()
        return _error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.on_request_rejected()
        errors = exc.errors()
        parts, param = [], None
        for error in errors:
            loc = [str(p) for p in error.get("loc", ()) if p != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
        return _error_response(400, "; ".join(parts) or "invalid request", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return _error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(500, f"{type(exc).__name__}: {exc}", "internal_server_error")

    # -------------------------------------------------------- operations

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            async_engine.check_health()
        except EngineDeadError as e:
            metrics.set_healthy(False)
            return JSONResponse({"status": "dead", "message": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def get_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=served_model_name, root=async_engine.core.config.model,
                         max_model_len=async_engine.max_model_len)
        return JSONResponse(dump(ModelList(data=[card])))

    # ------------------------------------------------------- completions

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        serving.check_model(body.model)
        serving.check_supported(body)
        prompt_ids = serving.completion_prompt_ids(body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = serving.sampling_params(body, max_tokens, body.logprobs)
        serving.check_context(len(prompt_ids), max_tokens, "prompt")
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await serving.add_request(prompt_ids, params, request_id, "prompt")
        want_logprobs = body.logprobs is not None

        if not body.stream:
            final = await serving.collect(stream, request)
            if final is None:
                return PlainTextResponse("client disconnected", status_code=499)
            choice = CompletionChoice(
                text=final.text, finish_reason=final.finish_reason,
                logprobs=serving.completion_logprobs(final, 0, len(final.token_ids), serving.text_offsets())
                if want_logprobs else None)
            response = CompletionResponse(id=request_id, created=created, model=served_model_name,
                                          choices=[choice], usage=_usage(final))
            return JSONResponse(dump(response))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunks(output: RequestOutput, state: _StreamState) -> list[Any]:
            delta = _text_delta(output, state.text)
            num_tokens = len(output.token_ids)
            payloads: list[Any] = []
            if delta or output.finished or (want_logprobs and num_tokens > state.num_tokens):
                if want_logprobs and state.text_offsets is None:
                    state.text_offsets = serving.text_offsets()
                choice = CompletionChoice(
                    text=delta, finish_reason=output.finish_reason if output.finished else None,
                    logprobs=serving.completion_logprobs(output, state.num_tokens, num_tokens, state.text_offsets)
                    if state.text_offsets is not None else None)
                payloads.append(dump(CompletionResponse(id=request_id, created=created, model=served_model_name,
                                                        choices=[choice])))
                state.text, state.num_tokens = state.text + delta, num_tokens
            if output.finished and include_usage:
                payloads.append(dump(CompletionResponse(id=request_id, created=created, model=served_model_name,
                                                        choices=[], usage=_usage(output))))
            return payloads

        return _EventStreamResponse(_events(stream, serving, chunks), media_type="text/event-stream")

    # -------------------------------------------------- chat completions

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        serving.check_model(body.model)
        serving.check_supported(body)
        tokenizer = serving.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise APIError(400, f"model `{served_model_name}` has no chat template; use /v1/completions",
                           param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors (jinja or raise_exception) are the caller's
            raise APIError(400, f"cannot render the chat template: {e}", param="messages") from None
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)  # the template renders BOS itself
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = requested if requested is not None else max(1, async_engine.max_model_len - len(prompt_ids))
        params = serving.sampling_params(body, max_tokens, top_logprobs)
        serving.check_context(len(prompt_ids), max_tokens, "messages")
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stream = await serving.add_request(prompt_ids, params, request_id, "messages")
        top = top_logprobs or 0

        if not body.stream:
            final = await serving.collect(stream, request)
            if final is None:
                return PlainTextResponse("client disconnected", status_code=499)
            choice = ChatCompletionChoice(
                message=ChatResponseMessage(content=final.text), finish_reason=final.finish_reason,
                logprobs=serving.chat_logprobs(final, 0, len(final.token_ids), top) if body.logprobs else None)
            response = ChatCompletionResponse(id=request_id, created=created, model=served_model_name,
                                              choices=[choice], usage=_usage(final))
            return JSONResponse(dump(response))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> Any:
            return dump(ChatCompletionStreamResponse(id=request_id, created=created, model=served_model_name,
                                                     choices=choices, usage=usage))

        def chunks(output: RequestOutput, state: _StreamState) -> list[Any]:
            payloads: list[Any] = []
            if not state.started:
                payloads.append(chunk([ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant", content=""))]))
                state.started = True
            delta = _text_delta(output, state.text)
            num_tokens = len(output.token_ids)
            if delta or (body.logprobs and num_tokens > state.num_tokens):
                payloads.append(chunk([ChatCompletionStreamChoice(
                    delta=DeltaMessage(content=delta),
                    logprobs=serving.chat_logprobs(output, state.num_tokens, num_tokens, top) if body.logprobs
                    else None)]))
                state.text, state.num_tokens = state.text + delta, num_tokens
            if output.finished:
                payloads.append(chunk([ChatCompletionStreamChoice(delta=DeltaMessage(),
                                                                  finish_reason=output.finish_reason)]))
                if include_usage:
                    payloads.append(chunk([], _usage(output)))
            return payloads

        return _EventStreamResponse(_events(stream, serving, chunks), media_type="text/event-stream")

    return app
