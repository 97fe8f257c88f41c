"""The OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

`build_app(async_engine, served_model_name, api_key=None)` returns the app;
`python -m engine.serve` runs it under uvicorn. Routes: `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions` (models with a chat template),
`GET /health` (503 once a worker is dead), `GET /metrics` (Prometheus text) and
`POST /reset_prefix_cache` (drops every cached KV block, as vLLM's route); with
--enable-sleep-mode also `POST /sleep`, `POST /wake_up` and `GET /is_sleeping`.

Every error body is OpenAI-shaped (errors.py). Streams are server-sent events ending
in `data: [DONE]` (sse.py); a client that goes away, streaming or not, has its request
aborted in the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.async_engine import AsyncEngine
from engine.entrypoints.openai.auth import APIKeyMiddleware
from engine.entrypoints.openai.errors import error_response, install_error_handlers
from engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, dump
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.metrics import CONTENT_TYPE
from executor.errors import EngineDeadError


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` as model `served_model_name`; with
    `api_key`, every /v1 route needs `Authorization: Bearer api_key`."""
    app = FastAPI(title="tp-runtime", summary="OpenAI-compatible tensor-parallel inference server")
    completions = OpenAIServingCompletion(async_engine, served_model_name)
    chat = OpenAIServingChat(async_engine, served_model_name)
    metrics = async_engine.metrics
    app.state.serving_completion, app.state.serving_chat = completions, chat
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    install_error_handlers(app, metrics)

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
        card = ModelCard(id=served_model_name, root=async_engine.core.config.model,
                         max_model_len=async_engine.max_model_len)
        return JSONResponse(dump(ModelList(data=[card])))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Any:
        return await completions.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
        return await chat.create_chat_completion(body, request)

    return app


def install_sleep_routes(app: FastAPI, async_engine: AsyncEngine) -> None:
    """vLLM's sleep-mode routes (only with --enable-sleep-mode): `POST /sleep?level=N`
    (0 pauses, 1 frees the KV cache and moves the weights to host memory, 2 frees both;
    `&abort=true` ends running requests instead of finishing them), `POST
    /wake_up[?tags=weights&tags=kv_cache]` and `GET /is_sleeping`. Requests sent while
    asleep wait for the wake-up."""

    async def call(fn: Any) -> JSONResponse:
        try:
            reports = await fn
        except ValueError as e:
            return error_response(400, str(e))
        except EngineDeadError as e:
            return error_response(503, str(e), type="service_unavailable_error")
        return JSONResponse({"status": "ok", "is_sleeping": async_engine.is_sleeping, "ranks": reports})

    @app.post("/sleep")
    async def sleep(level: int = 1, abort: bool = False) -> JSONResponse:
        return await call(async_engine.sleep(level, abort=abort))

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> JSONResponse:
        return await call(async_engine.wake_up(tags))

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": async_engine.is_sleeping})
