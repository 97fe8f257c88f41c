"""The per-request output stream of the AsyncEngine, and the errors raised from it.

A `RequestStream` belongs to the asyncio loop that created it: the engine-loop thread
never touches it directly, it posts items with `loop.call_soon_threadsafe(deliver, ...)`
(engine/engine_loop.py), and the consumer reads them with `async for`.
"""

from __future__ import annotations

import asyncio

from engine.outputs import RequestOutput
from executor.errors import EngineDeadError


class EngineShutdownError(EngineDeadError):
    """The engine was shut down while the request was pending, or before it arrived."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by someone other than its consumer."""


ACCEPTED = object()  # posted to a stream once the core took the request


class RequestStream:
    """The outputs of one request, consumed by `async for` on the loop that created it.

    Each item is the newest cumulative `RequestOutput`; the last has `finished=True`.
    An engine failure is raised from the iteration. `done` turns True once nothing more
    will come; a consumer that stops earlier must abort the request (as `generate` does).
    `deltas`: its outputs carry only what is new (RequestOutputKind.DELTA), so none may
    be skipped.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop,
                 deltas: bool = False) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.deltas = deltas
        self.done = False
        self.loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()  # the core took it, or refused it

    def receive(self, item: object) -> None:
        """On the consumer's loop: take one item posted by the engine thread (ACCEPTED,
        an output, or an exception: before acceptance, the refusal)."""
        if not self.accepted.done():
            if item is ACCEPTED:
                self.accepted.set_result(None)
            elif isinstance(item, BaseException):
                self.accepted.set_exception(item)
            return
        if item is not ACCEPTED:
            self._queue.put_nowait(item)  # type: ignore[arg-type]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        # A cumulative output holds every one before it: skip straight to the newest one
        # queued. A DELTA output holds only its own tokens, so each is given in turn.
        while (not self.deltas and isinstance(item, RequestOutput) and not item.finished
               and not self._queue.empty()):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item


def deliver(items: list[tuple[RequestStream, object]]) -> None:
    """On the consumers' loop: hand each posted item to its stream, in order."""
    for stream, item in items:
        stream.receive(item)
