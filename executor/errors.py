"""Errors the executor raises to the engine and its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """A worker process died (or the executor was shut down): this and every later call
    fail at once. The message names the rank and its exit code."""


class WorkerStartupError(RuntimeError):
    """A worker failed before it became ready; carries that rank's remote traceback."""


class RemoteWorkerError(RuntimeError):
    """A worker raised while running a method. The worker stays up; `remote_traceback`
    holds its traceback, which is also part of the message."""

    def __init__(self, rank: int, method: str, error: str, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed in {method}: {error}\n--- remote traceback (rank {rank}) ---\n{remote_traceback}")
        self.rank = rank
        self.method = method
        self.error = error
        self.remote_traceback = remote_traceback


class ShmSpaceError(WorkerStartupError):
    """The shared-memory directory (/dev/shm) cannot hold the worker group's segments;
    the message names the directory, the bytes free and the bytes needed."""


class TempDirError(WorkerStartupError):
    """The temp directory (TMPDIR) cannot hold the engine's private directory; the
    message names it."""
