"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; `install_error_handlers` renders it, and every other failure
(pydantic validation, HTTP errors from routing, unexpected exceptions), in that shape.
Invalid requests are 400s and count as rejected in the metrics; the server stays up.
A body that is not JSON gets a message saying so, with the decoder's reason and the
character position. Every message is rendered safely: text the client sent that is
not valid Unicode (a lone surrogate in a model name, a dict key) is shown escaped
(`\\ud800`), so rendering an error can never fail into a 500.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.entrypoints.openai.api_error import APIError
from engine.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, dump
from engine.metrics import EngineMetrics
from executor.errors import EngineDeadError


def error_response(status_code: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body with `status_code`; strings that cannot be encoded as
    UTF-8 (lone surrogates echoed from a request) are backslash-escaped."""
    body = ErrorResponse(error=ErrorInfo(message=_utf8_safe(message), type=type, param=_utf8_safe(param),
                                         code=_utf8_safe(code)))
    return JSONResponse(dump(body), status_code=status_code)


def _utf8_safe(text: str | None) -> str | None:
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# FastAPI's detail when the body cannot be decoded at all (not UTF-8, nested too deeply).
_FASTAPI_BODY_ERROR = "There was an error parsing the body"


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The error body for a failure in the middle of a stream (sent as its last event):
    a dead engine is a service_unavailable_error, anything else an internal one."""
    if isinstance(exc, EngineDeadError):
        info = ErrorInfo(message=str(exc), type="service_unavailable_error")
    else:
        info = ErrorInfo(message=f"{type(exc).__name__}: {exc}", type="internal_server_error")
    return dump(ErrorResponse(error=info))


def install_error_handlers(app: FastAPI, metrics: EngineMetrics) -> None:
    """Render every error `app` raises OpenAI-style; 400s count in `metrics` as rejected."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        if exc.status_code == 400:
            metrics.on_request_rejected()
        return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.on_request_rejected()
        errors = exc.errors()
        bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if bad_json is not None:
            loc = bad_json.get("loc", ())
            reason = (bad_json.get("ctx") or {}).get("error", "JSON decode error")
            where = f" (at character {loc[-1]})" if len(loc) > 1 and isinstance(loc[-1], int) else ""
            return error_response(400, f"The request body is not valid JSON: {reason}{where}")
        parts, param = [], None
        for error in errors:
            loc = [str(p) for p in error.get("loc", ()) if p != "body"]
            param = param or (loc[0] if loc else None)
            parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
        return error_response(400, "; ".join(parts) or "invalid request", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == _FASTAPI_BODY_ERROR:
            metrics.on_request_rejected()
            detail = ("The request body could not be parsed: it must be a JSON object in UTF-8, nested at most a "
                      "few hundred levels deep")
        return error_response(exc.status_code, detail, kind)

    @app.exception_handler(Exception)
    async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"{type(exc).__name__}: {exc}", "internal_server_error")
