"""Starting one WorkerProc per TP rank, and the ready handshake (vLLM's
`UnreadyWorkerProcHandle` / `WorkerProcHandle`).

Called by MultiprocExecutor at start-up, on the engine's thread. `make_worker_process`
starts a rank with two pipes: the ready pipe, over which the rank sends one
ReadyMessage (READY with its timings, or FAILED with its traceback), and the death
pipe, whose read end the rank holds: when the engine closes its end (shutdown) or dies,
however it dies, the rank exits (it also sets PR_SET_PDEATHSIG). Workers take the
engine's TP_* environment variables at start (the forkserver's own were fixed when it
started). `wait_for_ready` waits for every READY: a rank that fails or dies first makes
the whole start fail, with its traceback; the caller then shuts down what it started.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, NamedTuple

from executor.errors import WorkerStartupError
from executor.rpc import ReadyMessage
from executor.worker_proc import WorkerProc

if TYPE_CHECKING:
    from config import EngineConfig
    from executor.message_queue import MessageQueueHandle

__all__ = ["STARTUP_TIMEOUT_S", "UnreadyWorkerProcHandle", "WorkerProcHandle", "make_worker_process",
           "wait_for_ready"]

STARTUP_TIMEOUT_S = float(os.environ.get("TP_WORKER_STARTUP_TIMEOUT", "600"))


class WorkerProcHandle(NamedTuple):
    """One started rank, as the engine holds it until shutdown."""

    rank: int
    proc: BaseProcess
    death_writer: Connection  # the engine's end of the death pipe: closing it stops the rank

    def death_message(self, when: str) -> str:
        """'worker rank R (pid P) died `when` with exit code C', after up to a second
        for the exit code to be known."""
        self.proc.join(timeout=1)
        return f"worker rank {self.rank} (pid {self.proc.pid}) died {when} with exit code {self.proc.exitcode}"


class UnreadyWorkerProcHandle(NamedTuple):
    """A started rank whose ReadyMessage is not in yet: its handle and the engine's end
    of its ready pipe (closed by `wait_for_ready`)."""

    handle: WorkerProcHandle
    ready_pipe: Connection


def make_worker_process(ctx: BaseContext, config: EngineConfig, rank: int, init_method: str,
                        broadcast_handle: MessageQueueHandle, reply_handle: MessageQueueHandle, ipc_dir: str,
                        board_name: str, env: dict[str, str]) -> UnreadyWorkerProcHandle:
    """Start rank `rank`'s WorkerProc (a daemon process of `ctx`) on the given queues,
    rendezvous and liveness board, with the TP_* variables `env`."""
    ready_r, ready_w = ctx.Pipe(duplex=False)
    death_r, death_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=WorkerProc.worker_main,
        name=f"WorkerProc-TP{rank}",
        args=(config, rank, rank, init_method, broadcast_handle, reply_handle, ready_w, death_r, ipc_dir, board_name,
              env),
        daemon=True,
    )
    proc.start()
    # Our copies of the child's ends must go, or EOF would never be seen.
    ready_w.close()
    death_r.close()
    return UnreadyWorkerProcHandle(WorkerProcHandle(rank, proc, death_w), ready_r)


def wait_for_ready(unready: list[UnreadyWorkerProcHandle], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until every rank sent READY. Raises WorkerStartupError naming the rank that
    reported FAILED (with its remote traceback) or died first, or the ranks not ready
    within `timeout_s` (TP_WORKER_STARTUP_TIMEOUT). Closes every ready pipe either way."""
    pending = {u.ready_pipe: u.handle for u in unready}
    sentinels = {u.handle.proc.sentinel: u for u in unready}
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerStartupError(
                    f"ranks {sorted(h.rank for h in pending.values())} not ready after {timeout_s:.0f}s "
                    "(TP_WORKER_STARTUP_TIMEOUT)"
                )
            for obj in wait([*pending, *sentinels], timeout=remaining):
                if obj in pending:
                    handle = pending.pop(obj)
                    try:
                        msg: ReadyMessage = obj.recv()
                    except EOFError:
                        raise WorkerStartupError(_startup_death_message(handle)) from None
                    if not msg.ok:
                        raise WorkerStartupError(
                            f"rank {handle.rank} failed during start-up: {msg.error}\n"
                            f"--- remote traceback (rank {handle.rank}) ---\n{msg.traceback}"
                        )
                elif obj in sentinels:
                    dead = sentinels.pop(obj)
                    if dead.ready_pipe in pending and not dead.ready_pipe.poll():
                        raise WorkerStartupError(_startup_death_message(dead.handle))
    finally:
        for u in unready:
            u.ready_pipe.close()


def _startup_death_message(handle: WorkerProcHandle) -> str:
    # The usual cause of a silent early death: the child re-imports the parent's
    # __main__ script, which starts another engine at import time.
    return (
        handle.death_message("during start-up")
        + "; see its stderr. A script that creates an engine must do so under `if __name__ == '__main__':`"
    )
