"""The liveness verdicts on one multiprocess worker group (vLLM's worker monitor).

Every rank writes a status row (heartbeat, current call, progress, collective entry)
to a shared board (executor/liveness.py). `WorkerMonitor` reads it, with the ranks'
process sentinels, and fails the group, naming the rank, when

- a rank dies (its sentinel fires, or a peer reports the death first);
- a rank stops beating, or hangs in a step (busy in a call the liveness check judges,
  outside any collective, no progress) for `worker_liveness_timeout_s`;
- a call failed on one rank while another still ran it, and each rank still in it is
  stuck (waiting in a collective the failed rank left, or no progress, for about a
  second): the group is out of step, and a further call's collectives would pair with
  the stuck one. Such a call is settled (`settle`) before the next call is sent.

A failed group's workers are SIGKILLed and `on_fail` wakes every caller blocked on a
reply; every later check raises EngineDeadError with the first reason, at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Callable

from executor import liveness
from executor.errors import EngineDeadError

if TYPE_CHECKING:
    from executor.liveness import StatusBoard
    from executor.worker_proc_handle import WorkerProcHandle

__all__ = ["WorkerMonitor", "pid_alive"]

logger = logging.getLogger(__name__)

# How often the monitor thread checks deaths and the liveness board.
MONITOR_POLL_S = 0.1
# After a call failed on one rank, another rank still running it that waits in a
# collective (or shows no progress) this long is taken as stuck for good.
_SETTLE_GRACE_S = 1.0


def pid_alive(pid: int | None) -> bool:
    """Whether `pid` runs. Read off /proc, not the Process object: a forkserver child is
    reaped by the forkserver, whose report reaches us some time after the death."""
    if pid is None:
        return False
    if not os.path.isdir("/proc"):
        return True  # no way to tell here; the monitor's sentinel wait will
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


class WorkerMonitor:
    """Failure state and verdicts of one ready worker group. Made by MultiprocExecutor
    once every rank is READY; `start` runs the monitor thread. `fail`, `raise_if_failed`,
    `settle(wait=False)` and `find_hung_rank` are safe from any thread; `note_failure`
    and `settle()` are called by the thread that sends calls (under its RPC lock)."""

    def __init__(self, workers: list[WorkerProcHandle], board: StatusBoard, liveness_s: float,
                 on_fail: Callable[[], None]) -> None:
        self.workers = workers
        self.board = board
        self.liveness_s = liveness_s
        self._on_fail = on_fail
        self.failure: str | None = None  # the first reason the group failed for
        self._fail_lock = threading.Lock()
        # Ids of calls whose silence the liveness check judges (a user's callable may
        # sleep at will); the sending thread adds and discards them.
        self.checked_calls: set[int] = set()
        # A call that failed on some rank while others may still be running it:
        # (call_id, name, failed rank, when). Read and cleared only under _settle_lock.
        self._unsettled: tuple[int, str, int, float] | None = None
        self._settle_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._monitor_workers, name="worker-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Shutdown has begun: the ranks' exits from now on are no failure."""
        self._stopping = True

    def join(self) -> None:
        """Wait (a bounded time) for the monitor thread, unless called from it."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * MONITOR_POLL_S + 1.0)

    def _monitor_workers(self) -> None:
        sentinels = {w.proc.sentinel: w for w in self.workers}
        while not self._stopping and self.failure is None:
            died = wait(list(sentinels), timeout=MONITOR_POLL_S)
            if self._stopping or self.failure is not None:
                return
            if died:
                self.fail(sentinels[died[0]].death_message("unexpectedly"))
                return
            hung = self.find_hung_rank()
            if hung is not None:
                self.fail(hung)
                return

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(self.failure)

    def fail(self, reason: str) -> None:
        """Mark the group dead for `reason` (the first reason wins), wake every caller
        blocked on a reply (it raises EngineDeadError now) and SIGKILL the workers: a
        group with a dead, hung or out-of-step rank can run nothing more, and its other
        ranks would otherwise spin in a collective until shutdown."""
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = reason
        logger.error("%s; the executor is dead", reason)
        self._on_fail()
        for worker in self.workers:
            if worker.proc.exitcode is None:
                try:
                    worker.proc.kill()
                except (OSError, ValueError):
                    pass  # already gone

    def fail_if_a_rank_died(self) -> None:
        """A rank replied with a failure: a peer of a rank that just died may report the
        death (a collective that saw it) before the monitor thread does. If a rank is
        dead, that is the cause: fail the group naming it and raise EngineDeadError."""
        for worker in self.workers:
            if not pid_alive(worker.proc.pid):
                self.fail(worker.death_message("unexpectedly"))
                raise EngineDeadError(self.failure)

    def find_hung_rank(self) -> str | None:
        """The liveness verdict on the board, or None while every rank looks alive."""
        limit = self.liveness_s
        if not limit:
            return None
        now = time.monotonic()
        for rank in range(self.board.world_size):
            row = self.board.row(rank)
            pid = int(row[liveness.PID])
            beat = row[liveness.HEARTBEAT]
            if beat and now - beat > limit:
                return (f"worker rank {rank} (pid {pid}) sent no heartbeat for {now - beat:.1f}s "
                        f"(worker_liveness_timeout_s={limit:g}): its process is stopped or frozen")
            call = int(row[liveness.BUSY_CALL])
            if (call and call in self.checked_calls and not row[liveness.IN_COLLECTIVE]
                    and now - row[liveness.PROGRESS] > limit):
                return (f"worker rank {rank} (pid {pid}) is hung: busy in a step for {now - row[liveness.BUSY_SINCE]:.1f}s "
                        f"with no progress for {now - row[liveness.PROGRESS]:.1f}s (its main thread used no CPU "
                        f"and entered no collective; worker_liveness_timeout_s={limit:g})")
        return None

    def note_failure(self, call_id: int, name: str, rank: int) -> None:
        """Rank `rank` failed in `call_id`: remember it if another rank has not finished it."""
        if any(self.board.row(r)[liveness.DONE_CALL] < call_id for r in range(self.board.world_size)):
            with self._settle_lock:
                self._unsettled = (call_id, name, rank, time.monotonic())

    def settle(self, wait: bool = True) -> None:
        """Before the next call: every rank must have finished the call that failed on
        one of them (if any). With `wait`, waits while a rank still runs it and makes
        progress; raises EngineDeadError, after failing the group, when each rank still
        in it is stuck (waiting in a collective, or no progress, for _SETTLE_GRACE_S),
        since the failed rank will never join that collective.

        Without `wait` (a health check, from any thread) it never blocks: one look at
        the board, and none at all while another thread is settling (that thread holds
        the settle lock and reaches the same verdict)."""
        if self._unsettled is None:
            return
        if not self._settle_lock.acquire(blocking=wait):
            return
        try:
            self._settle_locked(wait)
        finally:
            self._settle_lock.release()

    def _settle_locked(self, wait: bool) -> None:
        if self._unsettled is None:  # settled by another thread since the look above
            return
        call_id, name, failed_rank, failed_at = self._unsettled
        while True:
            self.raise_if_failed()
            now = time.monotonic()
            pending = [r for r in range(self.board.world_size) if self.board.row(r)[liveness.DONE_CALL] < call_id]
            if not pending:
                self._unsettled = None
                return
            stuck = []
            for r in pending:
                row = self.board.row(r)
                entered = row[liveness.IN_COLLECTIVE]
                silent = now - row[liveness.PROGRESS]
                # Or in a step sent before it, whose failure elsewhere made this one fail.
                in_failed_call = 0 < int(row[liveness.BUSY_CALL]) <= call_id
                if (in_failed_call and ((entered and now - entered > _SETTLE_GRACE_S) or silent > _SETTLE_GRACE_S)) \
                        or (self.liveness_s and silent > self.liveness_s):
                    stuck.append(r)
            if len(stuck) == len(pending) and now - failed_at > _SETTLE_GRACE_S:
                self.fail(
                    f"rank(s) {pending} can never finish {name!r} (call {call_id}): rank {failed_rank} failed in it "
                    "while they wait in a collective it left; the ranks are out of step, so the executor is dead"
                )
                raise EngineDeadError(self.failure)
            if not wait:
                return
            time.sleep(0.02)
