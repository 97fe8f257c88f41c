"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

`build_app(async_engine, served_model_name, api_key=None, *, generation_config="auto",
max_logprobs=20)` returns the app; `python -m engine.serve` runs it under uvicorn.
`served_model_name` is one name or several (vLLM's `--served-model-name a b`): a request
may name any of them, responses and metrics report the first. Routes: `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions` (models with a chat template),
`POST /tokenize`, `POST /detokenize` (serving_tokenization.py), `GET /health` and
`GET|POST /ping` (503 once a worker is dead), `GET /version`, `GET /metrics`
(Prometheus text, engine/metrics.py) and `POST /reset_prefix_cache` (drops every
cached KV block, as vLLM's route); with --enable-sleep-mode also `POST /sleep`,
`POST /wake_up` and `GET /is_sleeping`.

Every error body is OpenAI-shaped (errors.py). Streams are server-sent events ending
in `data: [DONE]` (sse.py); a client that goes away, streaming or not, has its request
aborted in the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.async_engine import AsyncEngine
from engine.entrypoints.openai.auth import APIKeyMiddleware
from engine.entrypoints.openai.body_limit import BodyLimitMiddleware
from engine.entrypoints.openai.errors import error_response, install_error_handlers
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, dump
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from engine.metrics import CONTENT_TYPE
from engine.version import package_version
from executor.errors import EngineDeadError


def _model_names(served_model_name: str | Sequence[str] | None, served_model_names: Sequence[str] | None) -> list[str]:
    names = list(served_model_names) if served_model_names is not None else (
        [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or []))
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served model names must be non-empty strings, got {names!r}")
    return names


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    *,
    served_model_names: Sequence[str] | None = None,
    generation_config: str = "auto",
    max_logprobs: int = 20,
    enable_log_requests: bool = False,
    max_log_len: int | None = None,
    enable_prompt_tokens_details: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `async_engine` under `served_model_name` (one name or a
    list; `served_model_names` is the same as a keyword); with `api_key`, every
    route but /health and /ping needs `Authorization: Bearer api_key` (auth.py).
    `generation_config` ("auto", "vllm" or a directory) and `max_logprobs` (-1: no
    limit) are vLLM's flags of those names, kept in `app.state`; so are
    `enable_log_requests` and `max_log_len` (one INFO line per request received).
    `enable_prompt_tokens_details` reports prefix-cache hits in usage; the chat route
    parses tool calls with `tool_call_parser` (tool_choice "auto" also needs
    `enable_auto_tool_choice`) and thinking with `reasoning_parser` (vLLM's flags)."""
    names = _model_names(served_model_name, served_model_names)
    main_name, aliases = names[0], set(names[1:])
    app = FastAPI(title="tp-runtime", summary="OpenAI-compatible tensor-parallel inference server")
    serving_options = dict(generation_config=generation_config, max_logprobs=max_logprobs,
                           enable_log_requests=enable_log_requests, max_log_len=max_log_len,
                           enable_prompt_tokens_details=enable_prompt_tokens_details)
    completions = OpenAIServingCompletion(async_engine, main_name, **serving_options)
    chat = OpenAIServingChat(async_engine, main_name, **serving_options, enable_auto_tools=enable_auto_tool_choice,
                             tool_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    tokenization = OpenAIServingTokenization(async_engine, names)
    metrics = async_engine.metrics
    app.state.serving_completion, app.state.serving_chat = completions, chat
    app.state.serving_tokenization = tokenization
    app.state.served_model_names = names
    app.state.generation_config, app.state.max_logprobs = generation_config, max_logprobs
    # Added first, so it runs inside the key check: an unauthenticated body is never read.
    app.add_middleware(BodyLimitMiddleware, on_reject=metrics.on_request_rejected)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    install_error_handlers(app, metrics)

    def as_main_name(body: Any) -> Any:
        # Any served name is the model; the handlers know it by the first one, which
        # responses report (as vLLM does).
        if getattr(body, "model", None) in aliases:
            body.model = main_name
        return body

    async def health() -> JSONResponse:
        try:
            async_engine.check_health()
        except EngineDeadError as e:
            metrics.set_healthy(False)
            return JSONResponse({"status": "dead", "message": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) health route

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    @app.get("/metrics")
    async def get_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        try:
            dropped = await async_engine.reset_prefix_cache()
        except EngineDeadError as e:
            return JSONResponse({"status": "dead", "message": str(e)}, status_code=503)
        return JSONResponse({"status": "ok", "num_blocks_dropped": dropped})

    if async_engine.core.config.enable_sleep_mode:
        install_sleep_routes(app, async_engine)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [ModelCard(id=name, root=async_engine.core.config.model, max_model_len=async_engine.max_model_len)
                 for name in names]
        return JSONResponse(dump(ModelList(data=cards)))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        return await completions.create_completion(as_main_name(body), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        return await chat.create_chat_completion(as_main_name(body), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return await tokenization.detokenize(request)

    return app


def install_sleep_routes(app: FastAPI, async_engine: AsyncEngine) -> None:
    """vLLM's sleep-mode routes (only with --enable-sleep-mode): `POST /sleep?level=N`
    (0 pauses, 1 frees the KV cache and moves the weights to host memory, 2 frees both;
    `&abort=true` ends running requests instead of finishing them), `POST
    /wake_up[?tags=weights&tags=kv_cache]` and `GET /is_sleeping`. Requests sent while
    asleep wait for the wake-up."""

    deepest = {"level": 0}  # the level slept at since the last full wake-up (a deeper sleep deepens it)

    async def call(fn: Any, level: int | None = None) -> JSONResponse:
        try:
            reports = await fn
        except ValueError as e:
            return error_response(400, str(e))
        except EngineDeadError as e:
            return error_response(503, str(e), type="service_unavailable_error")
        sleeping = async_engine.is_sleeping
        deepest["level"] = max(deepest["level"], level or 0) if sleeping else 0
        async_engine.metrics.set_sleep_state(sleeping, deepest["level"])
        return JSONResponse({"status": "ok", "is_sleeping": sleeping, "ranks": reports})

    @app.post("/sleep")
    async def sleep(level: int = 1, abort: bool = False) -> JSONResponse:
        return await call(async_engine.sleep(level, abort=abort), level)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> JSONResponse:
        return await call(async_engine.wake_up(tags))

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": async_engine.is_sleeping})
