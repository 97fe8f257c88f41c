"""Server-sent events: one request's outputs as `data: {json}` events, then `data: [DONE]`.

A stream that fails (the engine died, the request was aborted) sends an OpenAI-style
error event before [DONE]. A client that goes away has its request aborted in the engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Send

from engine.request_stream import RequestAbortedError
from engine.entrypoints.openai.errors import error_payload
from engine.entrypoints.openai.logprobs import TextOffsets
from engine.outputs import RequestOutput
from executor.errors import EngineDeadError

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    """One SSE event carrying `payload` as compact JSON (non-ASCII text kept as is)."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class ChoiceState:
    """What a stream has sent of one choice: text, tokens, whether it began and ended."""

    text: str = ""
    num_tokens: int = 0
    started: bool = False
    finished: bool = False
    text_offsets: TextOffsets | None = None


@dataclass
class StreamState:
    """What a stream has sent so far, per choice index."""

    choices: dict[int, ChoiceState] = field(default_factory=dict)

    def choice(self, index: int) -> ChoiceState:
        return self.choices.setdefault(index, ChoiceState())


ChunkMaker = Callable[[int, RequestOutput, StreamState], list[Any]]
"""`make_chunks(prompt_index, output, state)`: the payloads for one output of the
request for prompt `prompt_index`; advances `state`."""


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


async def events(outputs: AsyncIterator[tuple[int, RequestOutput]], abort: Callable[[], None],
                 make_chunks: ChunkMaker, final_chunks: Callable[[], list[Any]] | None = None) -> AsyncIterator[str]:
    """Drive a request's outputs (tagged with their prompt's index) into SSE lines,
    then `final_chunks()` (the usage chunk). Errors become an error event, then [DONE];
    `abort()` ends whatever is unfinished (the client went away)."""
    state = StreamState()
    try:
        async for index, output in outputs:
            for payload in make_chunks(index, output, state):
                yield sse(payload)
        for payload in final_chunks() if final_chunks is not None else []:
            yield sse(payload)
    except (EngineDeadError, RequestAbortedError) as e:
        yield sse(error_payload(e))
    finally:
        abort()
    yield SSE_DONE


def event_stream_response(outputs: AsyncIterator[tuple[int, RequestOutput]], abort: Callable[[], None],
                          make_chunks: ChunkMaker,
                          final_chunks: Callable[[], list[Any]] | None = None) -> EventStreamResponse:
    """The `text/event-stream` response of one streamed request."""
    return EventStreamResponse(events(outputs, abort, make_chunks, final_chunks), media_type="text/event-stream")
