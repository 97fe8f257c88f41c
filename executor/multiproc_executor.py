"""MultiprocExecutor: one WorkerProc per TP rank, driven over shared memory.

Start-up: create the queues, start every rank, then wait for all READY messages on
the ready pipes (a rank that fails or dies first makes the whole start fail, with its
traceback, and nothing left running). Then the shm names are unlinked (everyone has
mapped them, so no crash can leak a segment) and a monitor thread watches the process
sentinels: any rank exiting marks the executor failed and cancels pending calls.

Processes: forkserver with torch and the worker stack preloaded (set
TP_WORKER_MULTIPROC_METHOD=spawn to change), so a rank forks from a warm interpreter.
Each worker holds the read end of a death pipe and sets PR_SET_PDEATHSIG, so it exits
when the engine process dies, however it dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from executor.abstract import Executor
from executor.errors import EngineDeadError, RemoteWorkerError, WorkerStartupError
from executor.message_queue import MessageQueueOwner, QueueClosedError, QueueEndpoint
from executor.message_queue_reader import MessageQueueReader
from executor.message_queue_writer import MessageQueueWriter
from executor.rpc import SHUTDOWN, ReadyMessage, RPCMethod, RPCReply, RPCRequest, plan_call
from executor.worker_proc import WorkerProc

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("TP_WORKER_STARTUP_TIMEOUT", "600"))
SHUTDOWN_GRACE_S = 5.0
# While one rank's reply is awaited, the other ranks' queues are checked for an early
# failure this often.
_ERROR_POLL_S = 0.1
_FORKSERVER_PRELOAD = ["torch", "executor.worker_proc"]

_Q = TypeVar("_Q", bound="MessageQueueOwner | QueueEndpoint")


def _mp_context() -> multiprocessing.context.BaseContext:
    method = os.environ.get("TP_WORKER_MULTIPROC_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"TP_WORKER_MULTIPROC_METHOD={method!r} is not valid; allowed: 'forkserver', 'spawn'")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        self._failure: str | None = None
        self._shutdown_started = False
        self._rpc_lock = threading.Lock()
        self._call_id = 0
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._death_writers: list[Connection] = []
        self._queues: list[MessageQueueOwner | QueueEndpoint] = []
        self._monitor: threading.Thread | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="tp-engine-")
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        start = time.perf_counter()
        ws = self.world_size
        # A FileStore in our private directory: no port to pick, nothing on the network.
        init_method = f"file://{os.path.join(self._ipc_dir, 'dist_store')}"
        # Each queue is recorded as soon as it exists, so a failure part-way still releases it.
        self._broadcast_owner = self._track(MessageQueueOwner(ws, ipc_dir=self._ipc_dir))
        self._reply_owners = [self._track(MessageQueueOwner(1, ipc_dir=self._ipc_dir)) for _ in range(ws)]
        self._broadcast = self._track(MessageQueueWriter(self._broadcast_owner.export_handle()))
        self._replies = [self._track(MessageQueueReader(q.export_handle(), 0)) for q in self._reply_owners]

        ctx = _mp_context()
        ready_readers: list[Connection] = []
        for rank in range(ws):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            death_r, death_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=WorkerProc.worker_main,
                name=f"WorkerProc-TP{rank}",
                args=(self.config, rank, rank, init_method, self._broadcast_owner.export_handle(),
                      self._reply_owners[rank].export_handle(), ready_w, death_r, self._ipc_dir),
                daemon=True,
            )
            proc.start()
            # Our copies of the child's ends must go, or EOF would never be seen.
            ready_w.close()
            death_r.close()
            self.processes.append(proc)
            ready_readers.append(ready_r)
            self._death_writers.append(death_w)
        self.startup_timings["spawn"] = time.perf_counter() - start
        self._wait_for_ready(ready_readers)
        self._broadcast.wait_until_ready(timeout=60)
        for queue in (self._broadcast_owner, *self._reply_owners):
            queue.unlink()
        self.startup_timings["startup_total"] = time.perf_counter() - start
        self._monitor = threading.Thread(target=self._monitor_workers, name="worker-monitor", daemon=True)
        self._monitor.start()

    def _track(self, queue: _Q) -> _Q:
        self._queues.append(queue)
        return queue

    def _wait_for_ready(self, ready_readers: list[Connection]) -> list[dict[str, float]]:
        timings: list[dict[str, float]] = [{} for _ in ready_readers]
        pending = {conn: rank for rank, conn in enumerate(ready_readers)}
        sentinels = {self.processes[rank].sentinel: rank for rank in range(len(ready_readers))}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WorkerStartupError(
                        f"ranks {sorted(pending.values())} not ready after {STARTUP_TIMEOUT_S:.0f}s "
                        "(TP_WORKER_STARTUP_TIMEOUT)"
                    )
                for obj in wait([*pending, *sentinels], timeout=remaining):
                    if obj in pending:
                        rank = pending.pop(obj)
                        try:
                            msg: ReadyMessage = obj.recv()
                        except EOFError:
                            raise WorkerStartupError(self._startup_death_message(rank)) from None
                        if not msg.ok:
                            raise WorkerStartupError(
                                f"rank {rank} failed during start-up: {msg.error}\n"
                                f"--- remote traceback (rank {rank}) ---\n{msg.traceback}"
                            )
                        timings[rank] = msg.timings
                    elif obj in sentinels:
                        rank = sentinels.pop(obj)
                        conn = ready_readers[rank]
                        if conn in pending and not conn.poll():
                            raise WorkerStartupError(self._startup_death_message(rank))
        finally:
            for conn in ready_readers:
                conn.close()
        return timings

    def _death_message(self, rank: int, when: str) -> str:
        proc = self.processes[rank]
        proc.join(timeout=1)
        return f"worker rank {rank} (pid {proc.pid}) died {when} with exit code {proc.exitcode}"

    def _startup_death_message(self, rank: int) -> str:
        # The usual cause of a silent early death: the child re-imports the parent's
        # __main__ script, which starts another engine at import time.
        return (
            self._death_message(rank, "during start-up")
            + "; see its stderr. A script that creates an engine must do so under `if __name__ == '__main__':`"
        )

    def _monitor_workers(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.processes)}
        died = wait(list(sentinels))
        if self._shutdown_started:
            return
        rank = sentinels[died[0]]
        self._failure = self._death_message(rank, "unexpectedly")
        logger.error("%s; the executor is dead", self._failure)
        # Wakes any caller blocked on a reply so it raises EngineDeadError now.
        for queue in self._replies:
            queue.shutdown()

    def check_health(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self._shutdown_started:
            raise EngineDeadError("the executor has been shut down")

    def _enqueue(self, request: RPCRequest, deadline: float | None, name: str) -> None:
        while True:
            self.check_health()
            slice_s = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
            try:
                self._broadcast.enqueue(request, timeout=slice_s)
                return
            except TimeoutError:
                # The ring is full: a rank is slow, stuck, or dead and about to be noticed.
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"collective_rpc({name!r}) timed out: a rank stopped reading requests") from None
            except QueueClosedError:
                self.check_health()
                raise EngineDeadError("a worker closed the broadcast queue") from None

    def collective_rpc(
        self,
        method: RPCMethod,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        plan = plan_call(method, unique_reply_rank, self.world_size)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._rpc_lock:
            self._call_id += 1
            call_id = self._call_id
            request = RPCRequest(call_id, plan.payload, tuple(args), dict(kwargs or {}), unique_reply_rank)
            self._enqueue(request, deadline, plan.name)
            results = self._collect_replies(plan.ranks, call_id, plan.name, deadline, timeout)
        return plan.results(results, unique_reply_rank)

    def _collect_replies(
        self, ranks: list[int], call_id: int, name: str, deadline: float | None, timeout: float | None
    ) -> dict[int, Any]:
        """Wait for `ranks`' replies to `call_id`. While the awaited rank is silent, the
        other queues are checked too: a rank that failed (and so left its peers blocked
        in a collective) is reported at once, by name, instead of after the timeout."""
        results: dict[int, Any] = {}
        waiting = list(ranks)
        while waiting:
            rank = waiting[0]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            slice_s = _ERROR_POLL_S if remaining is None else min(_ERROR_POLL_S, remaining)
            reply = self._next_reply(rank, call_id, slice_s)
            if reply is not None:
                results[rank] = self._result_of(reply, name)
                waiting.remove(rank)
                continue
            for other in range(self.world_size):
                if other == rank or other in results:
                    continue
                early = self._next_reply(other, call_id, 0.0)
                if early is not None:
                    # Only a failure arrives from a rank that was not asked.
                    results[other] = self._result_of(early, name)
                    if other in waiting:
                        waiting.remove(other)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"collective_rpc({name!r}) timed out after {timeout}s waiting for rank {rank}")
        return results

    def _next_reply(self, rank: int, call_id: int, timeout: float) -> RPCReply | None:
        """Rank's reply to `call_id`, or None if none came within `timeout`; replies to
        earlier calls that timed out are dropped."""
        while True:
            try:
                reply: RPCReply = self._replies[rank].dequeue(timeout=timeout)
            except TimeoutError:
                return None
            except QueueClosedError:
                self.check_health()
                raise EngineDeadError(f"rank {rank}'s reply queue closed") from None
            if reply.call_id == call_id:
                return reply

    @staticmethod
    def _result_of(reply: RPCReply, name: str) -> Any:
        if not reply.ok:
            raise RemoteWorkerError(reply.rank, name, reply.error or "", reply.traceback or "")
        return reply.result

    def shutdown(self) -> None:
        """Ask the workers to stop, close the death pipes, then SIGKILL whatever is left
        after the grace period; release every queue, segment and socket file."""
        if self._shutdown_started:
            return
        self._shutdown_started = True
        if self._failure is None and getattr(self, "_broadcast", None) is not None and self.processes:
            try:
                self._broadcast.enqueue(RPCRequest(-1, SHUTDOWN), timeout=1.0)
            except Exception:  # noqa: BLE001 - best effort; the pipes and signals follow
                pass
        for conn in self._death_writers:
            conn.close()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        # Workers ignore SIGTERM (see WorkerProc), so one still alive now gets SIGKILL.
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
        for proc in self.processes:
            proc.join()
        for queue in self._queues:
            queue.shutdown()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
