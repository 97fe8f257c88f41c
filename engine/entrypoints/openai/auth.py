"""API-key check: `Authorization: Bearer KEY` on every route but the liveness probes.

With `--api-key`, every HTTP request needs the key, whatever its path: the /v1 API,
/metrics, /reset_prefix_cache, the sleep routes, /tokenize, /version, the OpenAPI
pages, and paths that do not exist (a 401, not a 404, so routes cannot be probed).
Exempt: `/health` and `/ping`, the liveness probes that load balancers and
orchestrators call without credentials; they only say whether the engine is alive and
change nothing. (vLLM exempts /health alone; /ping is SageMaker's name for the same probe.)
"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.entrypoints.openai.errors import error_response

# Liveness probes only: add nothing here that reads or changes state.
UNAUTHENTICATED_PATHS = frozenset({"/health", "/ping"})


class APIKeyMiddleware:
    """Pure ASGI, so streamed bodies pass through untouched. A missing or wrong key gets
    a 401 with code `invalid_api_key`; CORS preflights (OPTIONS) carry no key and pass."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"].rstrip("/") not in UNAUTHENTICATED_PATHS
                and scope["method"] != "OPTIONS"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):  # constant time: no key guessing by timing
                response = error_response(401, "Incorrect or missing API key: send `Authorization: Bearer KEY`",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
