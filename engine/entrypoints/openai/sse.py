"""Server-sent events: one request's outputs as `data: {json}` events, then `data: [DONE]`.

A stream that fails (the engine died, the request was aborted) sends an OpenAI-style
error event before [DONE]. A client that goes away has its request aborted in the engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Send

from engine.async_engine import AsyncEngine, RequestAbortedError, RequestStream
from engine.entrypoints.openai.errors import error_payload
from engine.entrypoints.openai.logprobs import TextOffsets
from engine.outputs import RequestOutput
from executor.errors import EngineDeadError

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    """One SSE event carrying `payload` as compact JSON (non-ASCII text kept as is)."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class StreamState:
    """What a stream has sent so far: text, number of tokens, and any chunk at all."""

    text: str = ""
    num_tokens: int = 0
    started: bool = False
    text_offsets: TextOffsets | None = None


ChunkMaker = Callable[[RequestOutput, StreamState], list[Any]]
"""`make_chunks(output, state)`: the payloads for one output; advances `state`."""


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so the generator's
    `finally` (which aborts the request) runs even when the send side fails first."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def events(stream: RequestStream, engine: AsyncEngine, make_chunks: ChunkMaker) -> AsyncIterator[str]:
    """Drive one stream into SSE lines. Errors become an error event, then [DONE]; a
    stream left unfinished (the client went away) is aborted in `engine`."""
    state = StreamState()
    try:
        async for output in stream:
            for payload in make_chunks(output, state):
                yield sse(payload)
    except (EngineDeadError, RequestAbortedError) as e:
        yield sse(error_payload(e))
    finally:
        if not stream.done:
            engine.abort(stream.request_id)
    yield SSE_DONE


def event_stream_response(stream: RequestStream, engine: AsyncEngine, make_chunks: ChunkMaker) -> EventStreamResponse:
    """The `text/event-stream` response of one streamed request."""
    return EventStreamResponse(events(stream, engine, make_chunks), media_type="text/event-stream")
