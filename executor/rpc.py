"""The executor's RPC vocabulary: the messages on its queues and how a worker runs one.

Used by every executor: ``UniProcExecutor`` calls ``run_method`` in the engine's
process; ``MultiprocExecutor`` sends ``RPCRequest`` over the broadcast queue and each
``WorkerProc`` runs it with ``run_method`` and answers with an ``RPCReply`` (the Ray
actors answer the same way); both prepare the call with ``plan_call``. The
two per-call messages are `msgspec.Struct`s that ``executor/serial_utils.py`` encodes
as MessagePack (what a call carries, ``args``, ``kwargs`` and ``result``, may be
anything: see there for how each value crosses), so their layout must be identical in
the engine and every worker (they import this same module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import msgspec

__all__ = ["GRAMMAR_BITMASK", "SHUTDOWN", "CallPlan", "RPCMethod", "RPCReply", "RPCRequest", "ReadyMessage", "check_rpc_method",
           "plan_call", "run_method"]

# A Worker method name, or a picklable fn(worker, *args, **kwargs).
RPCMethod = str | Callable[..., Any]

# `method` value that tells a worker's busy loop to return.
SHUTDOWN = "__shutdown__"
# `method` value of a step's grammar bitmask, sent after the step itself (structured
# outputs, `grammar_follows`): args (the step's call id, the bitmask bytes or None,
# the engine's error or None). Read by the rank inside that step, never answered; one
# left over (the step failed before reading it) is dropped by the busy loop.
GRAMMAR_BITMASK = "__grammar_bitmask__"


# The two per-call messages: typed Structs, encoded as MessagePack arrays of their fields
# (``array_like``); built positionally or by keyword.
class RPCRequest(msgspec.Struct, array_like=True):
    call_id: int
    # A Worker method name, or a cloudpickled fn(worker, *args, **kwargs): str | bytes, which
    # msgspec cannot type as one union (MessagePack keeps str and bin apart all the same).
    method: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}
    reply_rank: int | None = None  # None: every rank replies
    # A step sent while this earlier one was still running (async scheduling): a rank on
    # which that call failed answers this one with a failure instead of running it.
    after_call: int | None = None


class RPCReply(msgspec.Struct, array_like=True):
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


class CallPlan(NamedTuple):
    """What an executor that sends a call to worker processes needs before it sends it."""

    name: str  # for error messages
    payload: str | bytes  # a Worker method name, or the cloudpickled callable
    ranks: list[int]  # whose replies the caller waits for, in order

    def results(self, replies: dict[int, Any], unique_reply_rank: int | None) -> Any:
        """collective_rpc's return value: that one rank's result, or every rank's in order."""
        return replies[unique_reply_rank] if unique_reply_rank is not None else [replies[r] for r in self.ranks]


def check_rpc_method(method: object) -> None:
    """Raises TypeError, in the caller, for a collective_rpc method that is neither a
    Worker method name nor a callable (bytes, say, which would reach the workers)."""
    if not isinstance(method, str) and not callable(method):
        raise TypeError(f"collective_rpc method must be a Worker method name or a callable fn(worker, ...), "
                        f"got {type(method).__name__!r}")


def plan_call(method: RPCMethod, unique_reply_rank: int | None, world_size: int) -> CallPlan:
    """Validate and prepare one collective_rpc of a process-based executor (mp, ray): the
    callable is pickled here, so an unpicklable one raises in the caller. Raises
    TypeError for a method that is neither a name nor a callable, ValueError for a
    `unique_reply_rank` outside the world."""
    check_rpc_method(method)
    if unique_reply_rank is not None and not 0 <= unique_reply_rank < world_size:
        raise ValueError(f"unique_reply_rank={unique_reply_rank} is outside [0, {world_size})")
    name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
    if isinstance(method, str):
        payload: str | bytes = method
    else:
        import cloudpickle

        payload = cloudpickle.dumps(method)
    ranks = [unique_reply_rank] if unique_reply_rank is not None else list(range(world_size))
    return CallPlan(name, payload, ranks)


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
