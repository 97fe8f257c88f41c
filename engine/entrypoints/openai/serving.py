"""What the completions and chat handlers share: request checks, sampling parameters
(with the model's generation-config defaults), submission to the engine, and waiting
for whole (not streamed) responses.

A handler calls `check_request(body)`, builds its prompt ids, then `sampling_params`
and `submit(...)`, which has the engine's input processor validate the request once,
on the event loop (the number of samples, truncation, this server's context-length
check, the token ids, the sampling fields against the model), and hands the engine
the processed request; the checks run in that order, so a request with several
problems gets the first one's 400. Every failure is an `APIError` (400 invalid, 404
unknown model, 500 aborted, 503 dead engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from config import SamplingParams
from engine.async_engine import AsyncEngine
from engine.entrypoints.openai.api_error import APIError
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokenUsageInfo,
    StreamOptions,
    UsageInfo,
    dump,
)
from engine.entrypoints.openai.structured_outputs_request import structured_outputs_params
from engine.outputs import RequestOutput
from engine.request_stream import RequestAbortedError, RequestStream
from executor.errors import EngineDeadError

logger = logging.getLogger(__name__)

DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
_PARAM_IN_MESSAGE = re.compile(r"^(\w+) must\b")
_FIELD_IN_MESSAGE = re.compile(r"^(stop_token_ids|allowed_token_ids|logit_bias|bad_words|stop)\b")
# The generation-config keys vLLM takes as sampling defaults ("max_new_tokens" -> max_tokens).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")

AnyRequest = CompletionRequest | ChatCompletionRequest


def load_generation_defaults(generation_config: str, model_dir: str) -> dict[str, Any]:
    """The sampling defaults `--generation-config` names: "auto" reads the model's
    generation_config.json, "vllm" uses none (vLLM's own defaults), anything else is a
    directory holding a generation_config.json (or that file). Raises ValueError for a
    path that holds none or a file that is not a JSON object."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(generation_config)
        if path.is_dir():
            path = path / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {generation_config!r}: no generation_config.json at {path}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--generation-config: {path} does not hold a JSON object")
    defaults = {key: raw[key] for key in GENERATION_CONFIG_KEYS if raw.get(key) is not None}
    if defaults:
        logger.info("Default sampling parameters have been overridden by %s: %s", path, defaults)
    return defaults


def _param_of(message: str, prompt_param: str) -> str:
    """The field a refusal names first in its message ("n must ...", "stop_token_ids [...]
    are outside ..."); else the prompt is at fault."""
    match = _PARAM_IN_MESSAGE.match(message) or _FIELD_IN_MESSAGE.match(message)
    return match.group(1) if match else prompt_param


def _wait_for_disconnect(request: Request) -> Any:
    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return wait()


def usage(prompt_lens: list[int], outputs: list[RequestOutput], cached_tokens: bool = False) -> UsageInfo:
    """Token counts: every prompt once, every sample's tokens; with ``cached_tokens``
    (--enable-prompt-tokens-details) also the prompt tokens the prefix cache supplied,
    when there are any (vLLM leaves the details out at 0)."""
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for output in outputs for o in output.outputs)
    info = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    cached = sum(output.num_cached_tokens for output in outputs) if cached_tokens else 0
    if cached:
        info.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)
    return info


def text_delta(text: str, finished: bool, sent: str) -> str:
    """New text since `sent`. An unfinished text ending in U+FFFD is held back: it is
    probably a multi-byte character whose remaining bytes come with the next tokens."""
    if not finished and text.endswith("\ufffd"):
        return ""
    return text[len(sent):]


def include_usage(stream_options: StreamOptions | None) -> tuple[bool, bool]:
    """Whether a stream ends with a usage-only chunk, and whether every chunk carries usage."""
    if stream_options is None:
        return False, False
    return stream_options.include_usage, stream_options.include_usage and stream_options.continuous_usage_stats


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, tagged with the stream's index; an
    error from any stream is raised from the iteration."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class OpenAIServing:
    """The handlers' shared logic, bound to one engine and one served model name.
    ``enable_prompt_tokens_details`` (vLLM's flag) adds the prefix-cache hits to usage."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, *, generation_config: str = "auto",
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, enable_log_requests: bool = False,
                 max_log_len: int | None = None, enable_prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.max_logprobs = max_logprobs
        self.enable_log_requests = enable_log_requests
        self.max_log_len = max_log_len
        self.defaults = load_generation_defaults(generation_config, engine.core.config.model)

    def check_request(self, body: AnyRequest) -> None:
        """The model is the one served and every field set is one this server honours;
        fields vLLM does not know either are logged and ignored, as vLLM does."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        for param, message in body.unsupported_fields():
            raise APIError(400, message, param=param)
        ignored = body.ignored_fields()
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", ignored)

    def check_logprobs(self, name: str, value: int | None) -> None:
        if value is not None and self.max_logprobs >= 0 and value > self.max_logprobs:
            raise APIError(400, f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {value}",
                           param=name)

    def default_max_tokens(self) -> int | None:
        """The generation config's max_new_tokens, if it has one."""
        value = self.defaults.get("max_new_tokens")
        return value if isinstance(value, int) and value > 0 else None

    def sampling_params(self, body: AnyRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams: its fields, else the generation config's, else
        OpenAI's defaults. A bad value is a 400 naming the field."""
        self.check_logprobs("logprobs", logprobs)
        self.check_logprobs("prompt_logprobs", prompt_logprobs)

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(body, name)
            return value if value is not None else self.defaults.get(name, fallback)

        try:
            logit_bias = {int(token): bias for token, bias in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {list(body.logit_bias)[:5]}",
                           param="logit_bias") from None
        try:
            return SamplingParams(
                n=body.n,
                best_of=getattr(body, "best_of", None),
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                seed=body.seed,
                stop=[body.stop] if isinstance(body.stop, str) else list(body.stop),
                stop_token_ids=list(body.stop_token_ids),
                include_stop_str_in_output=body.include_stop_str_in_output,
                ignore_eos=body.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias,
                allowed_token_ids=body.allowed_token_ids,
                bad_words=list(body.bad_words),
                skip_special_tokens=body.skip_special_tokens,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                truncation_side=body.truncation_side or "left",
                structured_outputs=structured_outputs_params(body, self.engine.processor.check_structured_outputs),
            )
        except ValueError as e:
            # SamplingParams says "<field> must ...": name that field as the error's param.
            match = _PARAM_IN_MESSAGE.match(str(e))
            raise APIError(400, str(e), param=match.group(1) if match else None) from None

    def request_id(self, body: AnyRequest, prefix: str) -> str:
        """`{prefix}-{request_id}` (the client's, as vLLM's field), else a fresh hex id."""
        return f"{prefix}-{body.request_id or uuid.uuid4().hex}"

    async def submit(self, body: AnyRequest, prompt_ids: list[int], params: SamplingParams, prompt_param: str,
                     request_id: str) -> tuple[RequestStream, list[int]]:
        """Validate the request once, here on the event loop (engine/processor.py: the
        number of samples, truncate_prompt_tokens, then this server's context-length
        check and request log, then the token ids and the sampling fields against the
        model), and hand the processed request to the engine. Returns the stream and
        the prompt ids as run."""

        def check_prompt(ids: list[int]) -> None:
            self._check_context(len(ids), params.max_tokens, prompt_param)
            if self.enable_log_requests:
                self._log_request(request_id, ids, params)

        try:
            request = self.engine.processor.process_inputs(request_id, prompt_ids, params, body.cache_salt,
                                                           check_prompt=check_prompt)
            stream = await self.engine.add_request(request)
        except ValueError as e:
            raise APIError(400, str(e), param=_param_of(str(e), prompt_param)) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), type="service_unavailable_error") from None
        return stream, request.prompt_token_ids

    def _log_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """vLLM's --enable-log-requests line, before the engine sees the request: its
        prompt's text and token ids (each cut to --max-log-len) and its parameters."""
        shown = prompt_ids if self.max_log_len is None else prompt_ids[: self.max_log_len]
        text = self.tokenizer.decode(shown)
        if self.max_log_len is not None:
            text = text[: self.max_log_len]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: None.",
                    request_id, text, params, shown)

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.done:
                self.engine.abort(stream.request_id)

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

    async def full_response(self, streams: list[RequestStream], request: Request,
                            build: Callable[[list[RequestOutput]], BaseModel]) -> Response:
        """The JSON response `build(final outputs)`, or a 499 if the client went away first."""
        finals = await self.collect(streams, request)
        if finals is None:
            return PlainTextResponse("client disconnected", status_code=499)
        return JSONResponse(dump(build(finals)))

    async def collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
        """The final outputs, or None if the client went away first (the requests are
        aborted). Raises APIError 503 if the engine died, 500 if a request was aborted."""

        async def consume(stream: RequestStream) -> RequestOutput:
            final = None
            async for output in stream:
                final = output
            assert final is not None
            return final

        consumer = asyncio.ensure_future(asyncio.gather(*(consume(s) for s in streams)))
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            self.abort(streams)
        if not consumer.done() or consumer.cancelled():
            return None
        try:
            return consumer.result()
        except EngineDeadError as e:
            raise APIError(503, str(e), type="service_unavailable_error") from None
        except RequestAbortedError as e:
            raise APIError(500, str(e), type="internal_server_error") from None
