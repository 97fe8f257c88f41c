"""Worker liveness: a shared-memory status board that every rank writes and the engine reads.

One row of float64 per rank (one cache line each), written only by that rank's worker
process, read by the engine's monitor thread and by `collective_rpc`:

    heartbeat      CLOCK_MONOTONIC time of the rank's heartbeat thread's last beat (every 0.5 s)
    busy_call      id of the call the rank is running now, 0 when idle
    busy_since     when it started that call
    done_call      id of the last call it finished (calls run in id order on every rank)
    progress       last time the rank's main thread showed progress: it started a call,
                   entered or left a TP collective, or used CPU time since the last beat
    in_collective  when it entered the TP collective it is in now, 0 outside one
    pid            the worker's pid

CLOCK_MONOTONIC is one clock for every process of a host, so the engine compares these
times with its own `time.monotonic()`. An aligned float64 store is atomic on the
architectures we run on, and each field has one writer, so no lock is needed; a reader
may see a row mid-update, which costs at most one poll of delay.

What the engine concludes (worker_monitor.py):
- no heartbeat for `worker_liveness_timeout_s`: the process is stopped or frozen;
- busy in a step, outside any collective, and no progress for that long: the rank hangs
  (a peer waiting for it is inside a collective, so only the culprit is named);
- after a call failed on one rank, a rank still running that call whose main thread is
  waiting in a collective (or shows no progress) can never finish it: the group is out
  of step, and no further call may be sent (its collectives would pair with the stuck one).

The segment is named like the message queues (`tpmq_<engine pid>_...`) and unlinked as
soon as every rank has mapped it, so no crash can leak it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from distributed.shm_utils import attach_shm

__all__ = ["HEARTBEAT_INTERVAL_S", "StatusBoard", "WorkerStatus"]

HEARTBEAT_INTERVAL_S = 0.5
# CPU time the main thread must use between two beats to count as progress: a thread
# blocked in a socket read or a sleep uses none; a computing one uses the whole interval.
_CPU_PROGRESS_S = 0.005

HEARTBEAT, BUSY_CALL, BUSY_SINCE, DONE_CALL, PROGRESS, IN_COLLECTIVE, PID = range(7)
_ROW = 8  # float64 per row: one 64-byte line


class StatusBoard:
    """The engine's side: creates the segment (one row per rank) and reads it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.name = f"tpmq_{os.getpid()}_{uuid.uuid4().hex[:8]}_status"
        self.nbytes = world_size * _ROW * 8
        # Registered with the resource tracker until unlink(), so a SIGKILLed engine's
        # segment is still removed.
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=self.name, create=True, size=self.nbytes)
        self._rows = np.ndarray((world_size, _ROW), dtype=np.float64, buffer=self._shm.buf)
        self._rows[:] = 0.0
        self._unlinked = False

    def row(self, rank: int) -> np.ndarray:
        return self._rows[rank]

    def unlink(self) -> None:
        """Idempotent: remove the name (every rank has mapped it); the mapping stays."""
        if self._unlinked or self._shm is None:
            return
        self._unlinked = True
        try:
            self._shm.unlink()
        except FileNotFoundError:
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]

    def close(self) -> None:
        self.unlink()
        shm, self._shm = self._shm, None
        if shm is not None:
            self._rows = np.zeros((self.world_size, _ROW))  # drop the view of the buffer first
            try:
                shm.close()
            except BufferError:
                pass  # a reader still holds a row; the mapping goes with the object


class WorkerStatus:
    """One rank's side: maps the board, writes its own row, runs the heartbeat thread."""

    def __init__(self, board_name: str, world_size: int, rank: int) -> None:
        self.rank = rank
        self._mm = attach_shm(board_name, world_size * _ROW * 8)
        self._row = np.ndarray((_ROW,), dtype=np.float64, buffer=self._mm, offset=rank * _ROW * 8)
        now = time.monotonic()
        self._row[PID] = os.getpid()
        self._row[PROGRESS] = now
        self._row[HEARTBEAT] = now
        self._collective_depth = 0
        self._stop = threading.Event()
        self._main_clock = time.pthread_getcpuclockid(threading.main_thread().ident)  # type: ignore[arg-type]
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        last_cpu = time.clock_gettime(self._main_clock)
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            now = time.monotonic()
            cpu = time.clock_gettime(self._main_clock)
            if cpu - last_cpu >= _CPU_PROGRESS_S:
                self._row[PROGRESS] = now
            last_cpu = cpu
            self._row[HEARTBEAT] = now

    def begin_call(self, call_id: int) -> None:
        now = time.monotonic()
        self._row[PROGRESS] = now
        self._row[BUSY_SINCE] = now
        self._row[BUSY_CALL] = call_id

    def end_call(self, call_id: int) -> None:
        self._row[DONE_CALL] = call_id
        self._row[BUSY_CALL] = 0
        self._row[PROGRESS] = time.monotonic()

    def enter_collective(self) -> None:
        self._collective_depth += 1
        if self._collective_depth == 1:
            now = time.monotonic()
            self._row[PROGRESS] = now
            self._row[IN_COLLECTIVE] = now

    def exit_collective(self) -> None:
        self._collective_depth -= 1
        if self._collective_depth == 0:
            self._row[IN_COLLECTIVE] = 0.0
            self._row[PROGRESS] = time.monotonic()

    def close(self) -> None:
        self._stop.set()
