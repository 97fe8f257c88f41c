"""API-key check: `Authorization: Bearer KEY` on every /v1 route (not /health, /metrics)."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.entrypoints.openai.errors import error_response


class APIKeyMiddleware:
    """Pure ASGI, so streamed bodies pass through untouched. A missing or wrong key gets
    a 401 with code `invalid_api_key`; CORS preflights (OPTIONS) carry no key and pass."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):  # constant time: no key guessing by timing
                response = error_response(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
