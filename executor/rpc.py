"""The executor's RPC vocabulary: the messages on its queues and how a worker runs one.

Used by both executors: ``UniProcExecutor`` calls ``run_method`` in the engine's
process; ``MultiprocExecutor`` sends ``RPCRequest`` over the broadcast queue and each
``WorkerProc`` runs it with ``run_method`` and answers with an ``RPCReply``. The
messages are pickled by the message queue, so their layout must be identical in the
engine and every worker (they import this same module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

__all__ = ["SHUTDOWN", "RPCMethod", "RPCReply", "RPCRequest", "ReadyMessage", "run_method"]

# A Worker method name, or a picklable fn(worker, *args, **kwargs).
RPCMethod = str | Callable[..., Any]

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


def run_method(worker: Any, method: RPCMethod | bytes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run one RPC on ``worker``, in the calling thread of the worker's process: a method
    by name, or a callable (plain, or cloudpickled bytes) called as ``fn(worker, ...)``.

    Whatever the method raises propagates (the caller turns it into a reply)."""
    if isinstance(method, str):
        return getattr(worker, method)(*args, **kwargs)
    if isinstance(method, bytes):
        import cloudpickle

        method = cloudpickle.loads(method)
    return method(worker, *args, **kwargs)
