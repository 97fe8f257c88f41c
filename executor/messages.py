"""Typed messages on the executor's queues (pickled by the MessageQueue)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

# `method` value that tells a worker's busy loop to return.
SHUTDOWN = "__shutdown__"


# The two per-call messages are NamedTuples: typed, but pickled as plain tuples, which
# takes a measurable share of a no-op RPC's round trip off compared with dataclasses.
class RPCRequest(NamedTuple):
    call_id: int
    method: str | bytes  # a Worker method name, or a cloudpickled fn(worker, *args, **kwargs)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    reply_rank: int | None = None  # None: every rank replies


class RPCReply(NamedTuple):
    call_id: int
    rank: int
    ok: bool
    result: Any = None
    error: str | None = None
    traceback: str | None = None


@dataclass(frozen=True)
class ReadyMessage:
    """Sent once over the ready pipe: READY with timings, or FAILED with the traceback."""

    rank: int
    ok: bool
    pid: int
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
