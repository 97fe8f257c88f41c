"""What the completions and chat handlers share: request checks, sampling parameters,
submission to the engine, and waiting for a whole (not streamed) response.

A handler calls `check_request(body)`, builds its prompt ids, then `start(...)`, which
validates the sampling parameters and the context length and submits the request; the
checks run in that order, so a request with several problems gets the first one's 400.
Every failure is an `APIError` (400 invalid, 404 unknown model, 500 aborted, 503 dead engine).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from engine.async_engine import AsyncEngine, RequestAbortedError, RequestStream
from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions, UsageInfo, dump
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from executor.errors import EngineDeadError

MAX_LOGPROBS = 20
_PARAM_IN_MESSAGE = re.compile(r"^(\w+) must\b")

AnyRequest = CompletionRequest | ChatCompletionRequest


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def usage(output: RequestOutput) -> UsageInfo:
    """Token counts of a (final) output."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def text_delta(output: RequestOutput, sent: str) -> str:
    """New text since `sent`. An unfinished text ending in U+FFFD is held back: it is
    probably a multi-byte character whose remaining bytes come with the next tokens."""
    text = output.text
    if not output.finished and text.endswith("\ufffd"):
        return ""
    return text[len(sent):]


def include_usage(stream_options: StreamOptions | None) -> bool:
    """Whether a stream ends with a usage-only chunk."""
    return bool(stream_options and stream_options.include_usage)


class OpenAIServing:
    """The handlers' shared logic, bound to one engine and one served model name."""

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer

    def check_request(self, body: AnyRequest) -> None:
        """The model is the one served and every field set is one this server honours."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        for param, message in body.unsupported_fields():
            raise APIError(400, message, param=param)

    async def start(self, body: AnyRequest, prompt_ids: list[int], max_tokens: int, logprobs: int | None,
                    prompt_param: str, id_prefix: str) -> tuple[RequestStream, str, int]:
        """Validate the sampling parameters and the context length, then submit the
        request. Returns its stream, id (`{id_prefix}-{hex}`) and creation time.
        `prompt_param` names the field the prompt came from in error messages."""
        params = self._sampling_params(body, max_tokens, logprobs)
        self._check_context(len(prompt_ids), max_tokens, prompt_param)
        request_id, created = f"{id_prefix}-{uuid.uuid4().hex}", int(time.time())
        try:
            stream = await self.engine.add_request(prompt_ids, params, request_id)
        except ValueError as e:
            raise APIError(400, str(e), param=prompt_param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="service_unavailable_error") from None
        return stream, request_id, created

    @staticmethod
    def _sampling_params(body: AnyRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            # SamplingParams says "<field> must ...": name that field as the error's param.
            match = _PARAM_IN_MESSAGE.match(str(e))
            raise APIError(400, str(e), param=match.group(1) if match else None) from None

    def _check_context(self, num_prompt_tokens: int, max_tokens: int, prompt_param: str) -> None:
        max_len = self.engine.max_model_len
        if num_prompt_tokens + max_tokens > max_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, {max_tokens} "
                "for the completion). Please reduce the length of the prompt or of the completion.",
                param=prompt_param,
            )

    async def full_response(self, stream: RequestStream, request: Request,
                            build: Callable[[RequestOutput], BaseModel]) -> Response:
        """The JSON response `build(final output)`, or a 499 if the client went away first."""
        final = await self.collect(stream, request)
        if final is None:
            return PlainTextResponse("client disconnected", status_code=499)
        return JSONResponse(dump(build(final)))

    async def collect(self, stream: RequestStream, request: Request) -> RequestOutput | None:
        """The final output, or None if the client went away first (the request is
        aborted). Raises APIError 503 if the engine died, 500 if the request was aborted."""

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
