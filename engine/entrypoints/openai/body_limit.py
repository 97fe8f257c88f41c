"""Request-body guard (ASGI middleware): bodies over a size limit, and JSON strings
that are not valid Unicode, are refused before any handler sees them.

Contract, for every HTTP request whatever its route:
- A body over `max_bytes` (default 10 MiB) gets a 413 with an OpenAI-shaped error
  (code `request_too_large`, the limit and the size in the message) and the connection
  is closed. A declared `Content-Length` over the limit is judged before a byte of the
  body is read. Nothing of it is kept, but up to `4 * max_bytes` of it is read and
  discarded before the answer (nginx's "lingering close"): a server that closes a
  socket with unread data makes the kernel reset the connection, and the reset can
  destroy the 413 before the client reads it. A larger body, or a client that sent
  `Expect: 100-continue` (it waits for us), is answered at once.
- A JSON body holding a lone UTF-16 surrogate (`"\\ud800"` with no pair, or its raw
  bytes ED A0..BF xx, which Python's JSON decoder lets through) gets a 400 naming the
  field (`messages.0.content`) and the position: such a string cannot be encoded as
  UTF-8, so the tokenizer or the response encoder would otherwise fail with a 500.
- Anything else passes through unchanged: the buffered body is handed to the app as one
  message, and every later `receive()` (a handler waiting for the client to disconnect)
  goes to the server as before. Responses are never touched, so streams are unaffected.

Refusals call `on_reject()` (the server counts them as rejected requests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.entrypoints.openai.errors import error_response

MAX_BODY_BYTES = 10 << 20
# How much of an oversized body is read (and dropped) before the 413, as a multiple of the limit.
_DRAIN_FACTOR = 4

# Cheap first pass over the raw bytes: a surrogate escape (\uD800-\uDFFF) or the raw
# UTF-8-style bytes of one. Only a hit pays for a full parse, and most hits are the valid
# pairs that ASCII-only JSON encoders (Python's json.dumps) write for emoji.
_SURROGATE_HINT = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class BodyLimitMiddleware:
    """See the module docstring. Pure ASGI, so response streams pass through untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES,
                 on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            waits_for_us = headers.get(b"expect", b"").lower() == b"100-continue"
            if int(declared) <= _DRAIN_FACTOR * self.max_bytes and not waits_for_us:
                if not await _discard_body(receive, _DRAIN_FACTOR * self.max_bytes):
                    return  # the client went away
            await self._refuse_too_large(scope, receive, send, f"{int(declared)} bytes")
            return
        if declared is None and b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            await self.app(scope, receive, send)  # no body (GET, HEAD, ...)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client went away before its body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                if message.get("more_body", False) and not await _discard_body(
                        receive, (_DRAIN_FACTOR - 1) * self.max_bytes):
                    return  # the client went away
                await self._refuse_too_large(scope, receive, send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = lone_surrogate(body) if _SURROGATE_HINT.search(body) else None
        if problem is not None:
            param, message_text = problem
            if self.on_reject is not None:
                self.on_reject()
            await error_response(400, message_text, param=param, code="invalid_unicode")(scope, receive, send)
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse_too_large(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        if self.on_reject is not None:
            self.on_reject()
        message = (f"Request body too large: {size}, over the limit of {self.max_bytes} bytes "
                   f"({self.max_bytes / (1 << 20):g} MiB)")
        # Connection: close, since the rest of the body is never read.
        response = error_response(413, message, code="request_too_large")
        response.headers["connection"] = "close"
        await response(scope, receive, send)


async def _discard_body(receive: Receive, limit: int) -> bool:
    """Read and drop the rest of the body, at most `limit` bytes of it. False if the
    client disconnected first (nothing left to answer)."""
    size = 0
    while size <= limit:
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return True


def lone_surrogate(body: bytes) -> tuple[str | None, str] | None:
    """(param, message) for the first string (value or key) of the JSON `body` that holds
    an unpaired UTF-16 surrogate, or None (also when `body` is not JSON: the app reports
    that itself). `param` is the top-level field, the message gives the full path."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[list[str], Any]] = [([], document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                found = _surrogate_at(key)
                if found is not None:
                    return _describe(path, found, f"the key {key.encode('utf-8', 'backslashreplace').decode()!r}")
                stack.append(([*path, key], item))
        elif isinstance(value, list):
            stack.extend(([*path, str(i)], item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, str):
            found = _surrogate_at(value)
            if found is not None:
                return _describe(path, found, "the string")
    return None


def _surrogate_at(text: str) -> tuple[int, str] | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start, f"\\u{ord(text[e.start]):04x}"
    return None


def _describe(path: list[str], found: tuple[int, str], what: str) -> tuple[str | None, str]:
    index, escape = found
    where = ".".join(path) or "body"
    message = (f"{where}: {what} has a lone UTF-16 surrogate ({escape}) at index {index}, which is not valid "
               "Unicode; send text as UTF-8, with surrogates only in pairs")
    return (path[0] if path else None), message
