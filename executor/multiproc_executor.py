"""MultiprocExecutor: one WorkerProc per TP rank, driven over shared memory.

Start-up: create the queues, start every rank, then wait for all READY messages on
the ready pipes (a rank that fails or dies first makes the whole start fail, with its
traceback, and nothing left running). Then the shm names are unlinked (everyone has
mapped them, so no crash can leak a segment) and a monitor thread watches the process
sentinels: any rank exiting marks the executor failed and cancels pending calls.

Processes: forkserver with torch and the worker stack loaded (set
TP_WORKER_MULTIPROC_METHOD=spawn to change), so a rank forks from a warm interpreter;
where it is safe, the forkserver is a fork of this process, made before the store or the
queues start a thread (executor/forked_forkserver.py), else the stock one importing its
preload.
Each worker holds the read end of a death pipe and sets PR_SET_PDEATHSIG, so it exits
when the engine process dies, however it dies. Workers take the engine's TP_*
environment variables at start (the forkserver's own were fixed when it started).

Files: the queues' sockets are files in a private 0700 directory (never abstract
names: those have no permissions), made inside this process's multiprocessing temp
directory (`pymp-*`, 0700, where the forkserver's own socket lives). The
torch.distributed rendezvous is a TCPStore this process serves on 127.0.0.1 only (a
port the kernel picks), so no store file exists. Shutdown removes the private
directory; when the engine dies instead, the forkserver (which outlives it for a
moment, SIGTERM or not) removes the whole `pymp-*` directory on its way out, and the
workers remove the private one (spawn method), so a SIGKILLed engine leaves nothing on
disk; the resource tracker removes any segment not yet unlinked. Before anything starts,
the temp directory must be writable (TempDirError naming it) and /dev/shm must hold
every segment of the group (ShmSpaceError names the directory and the bytes).

Liveness (executor/liveness.py): every rank writes a status row (heartbeat, current
call, progress, collective entry) to a shared board. The monitor thread fails the
executor, naming the rank, when a rank dies, stops beating, or hangs in a step (busy,
outside any collective, no progress) for `worker_liveness_timeout_s`; a failed executor
SIGKILLs its workers, and every pending and later call raises EngineDeadError at once.
A call that failed on one rank while another still runs it is settled before the next
call is sent: if the other rank is stuck waiting in a collective the failed rank left,
the group is out of step and the executor fails (within about a second) instead of
sending a call whose collectives would pair with the stuck one.

Async scheduling: `execute_model(non_block=True)` sends the step and returns a Future
at once, so the engine plans step N+1 while the ranks run step N and sends it before
N's result is back; each rank starts N+1 the moment it finishes N. Replies are
collected in the order the calls were sent: when a Future's result is asked for, or
before any other call goes out (so a collective_rpc never overtakes a step). A step
sent behind another names it (`after_call`): a rank on which the earlier step failed
answers the later one with a failure instead of running it, and a rank left waiting in
its collectives is found stuck by the settle check above.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from executor import liveness
from executor.abstract import EXECUTE_MODEL_TIMEOUT_S, Executor
from executor.errors import EngineDeadError, RemoteWorkerError, ShmSpaceError, TempDirError, WorkerStartupError
from executor.forked_forkserver import start_forked_forkserver
from executor.liveness import StatusBoard
from executor.message_queue import MessageQueueOwner, QueueClosedError, QueueEndpoint
from executor.message_queue_reader import MessageQueueReader
from executor.message_queue_writer import MessageQueueWriter
from executor.rpc import SHUTDOWN, CallPlan, ReadyMessage, RPCMethod, RPCReply, RPCRequest, plan_call
from executor.shm_ring import RingLayout, RingSpec
from executor.worker_proc import WorkerProc
from worker.cpu_affinity import allowed_cpus, spare_cpus

if TYPE_CHECKING:
    from worker.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("TP_WORKER_STARTUP_TIMEOUT", "600"))
SHUTDOWN_GRACE_S = 5.0
# While one rank's reply is awaited, the other ranks' queues are checked for an early
# failure this often.
_ERROR_POLL_S = 0.1
_FORKSERVER_PRELOAD = ["torch", "executor.worker_proc"]
# How often the monitor thread checks deaths and the liveness board.
_MONITOR_POLL_S = 0.1
# After a call failed on one rank, another rank still running it that waits in a
# collective (or shows no progress) this long is taken as stuck for good.
_SETTLE_GRACE_S = 1.0
# Calls whose silence the liveness check judges (a user's callable may sleep at will).
_LIVENESS_CHECKED = frozenset({"execute_model", "check_health"})
# Queue geometry (MessageQueueOwner's defaults), also used to size /dev/shm's needs.
_MQ_CHUNK_BYTES = 4 * 1024 * 1024
_MQ_CHUNKS = 8

_Q = TypeVar("_Q", bound="MessageQueueOwner | QueueEndpoint")


def _mp_context() -> multiprocessing.context.BaseContext:
    method = os.environ.get("TP_WORKER_MULTIPROC_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"TP_WORKER_MULTIPROC_METHOD={method!r} is not valid; allowed: 'forkserver', 'spawn'")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


def private_dir(method: str) -> str:
    """A fresh 0700 directory for one engine's socket files. Under the forkserver it is
    made inside multiprocessing's temp dir of this process (pymp-*), which the forkserver
    removes when this process dies (executor/worker_proc.py); otherwise in the temp
    directory. Raises TempDirError naming the directory (and TMPDIR) if it cannot."""
    env = os.environ.get("TMPDIR")
    if env and not (os.path.isdir(env) and os.access(env, os.W_OK | os.X_OK)):
        # Python would quietly fall back to /tmp; a TMPDIR that is set means a choice.
        raise TempDirError(f"TMPDIR={env!r} is not a writable directory: the engine keeps its sockets in a "
                           "private directory there; point TMPDIR at a writable directory (or unset it)")
    try:
        parent = mp_util.get_temp_dir() if method == "forkserver" else tempfile.gettempdir()
        return tempfile.mkdtemp(prefix="tp-", dir=parent)
    except OSError as e:
        raise TempDirError(f"cannot create the engine's private directory in {tempfile.gettempdir()!r} "
                           f"(TMPDIR={env!r}): {e}; point TMPDIR at a writable directory") from None


def _loopback_store() -> Any:
    """The rendezvous TCPStore, listening on 127.0.0.1 only: torch's own server binds
    every interface, so we hand it a socket bound here (a port the kernel picks)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the fd now
    return store


def _pid_alive(pid: int | None) -> bool:
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


def shm_dir() -> str:
    """Where POSIX shared memory lives (glibc: /dev/shm); TP_SHM_DIR names another
    mount for the start-up space check."""
    return os.environ.get("TP_SHM_DIR", "/dev/shm")


def shm_bytes_needed(config: Any, world_size: int) -> dict[str, int]:
    """Bytes of shared memory one worker group maps, by user."""
    ring = RingLayout.of(RingSpec("size", world_size, _MQ_CHUNK_BYTES, _MQ_CHUNKS)).total
    reply = RingLayout.of(RingSpec("size", 1, _MQ_CHUNK_BYTES, _MQ_CHUNKS)).total
    needs = {"message queues": ring + world_size * reply}
    if config.device_config.device_type == "cpu" and os.environ.get("TP_CPU_SHM_ALLREDUCE", "1") != "0":
        from distributed.device_communicators.shm_allreduce import DEFAULT_SLOT_BYTES

        needs["CPU all-reduce"] = world_size * 2 * DEFAULT_SLOT_BYTES + 2 * world_size * 64
    return needs


def check_shm_space(config: Any, world_size: int) -> None:
    """Raise ShmSpaceError unless the shared-memory directory can hold the group's
    segments. (tmpfs accepts a segment larger than its free space and the writer gets
    SIGBUS later, at the first touch of a missing page: so look first.)"""
    path = shm_dir()
    try:
        st = os.statvfs(path)
    except OSError as e:
        raise ShmSpaceError(f"cannot check the shared-memory directory {path} (TP_SHM_DIR): {e}") from None
    free = st.f_bavail * st.f_frsize
    needs = shm_bytes_needed(config, world_size)
    needed = sum(needs.values())
    if free < needed:
        parts = ", ".join(f"{k} {v}" for k, v in needs.items())
        raise ShmSpaceError(
            f"{path} has {free} bytes free, but tensor_parallel_size={world_size} needs {needed} bytes of shared "
            f"memory there ({parts}): free some space in {path} (in Docker: --shm-size), or set "
            "TP_CPU_SHM_ALLREDUCE=0 to keep the CPU all-reduce out of it"
        )


class _SentCall(NamedTuple):
    """A call on the broadcast queue whose replies are not collected yet."""

    call_id: int
    plan: CallPlan
    reply_rank: int | None
    deadline: float | None
    timeout: float | None
    checked: bool  # judged by the liveness check


class _StepFuture(Future):
    """A step sent ahead (execute_model(non_block=True)). Its replies are collected on
    the thread that asks for `result()`, or by the executor before its next call."""

    def __init__(self, executor: MultiprocExecutor, call: _SentCall) -> None:
        super().__init__()
        self._executor = executor
        self.call = call

    def result(self, timeout: float | None = None) -> Any:
        """The step's output; `timeout` is not used: the step's own deadline
        (TP_EXECUTE_MODEL_TIMEOUT) bounds the wait."""
        self._executor._collect_through(self)
        return super().result()


class MultiprocExecutor(Executor):
    supports_async_scheduling = True

    def _init_executor(self) -> None:
        self._failure: str | None = None
        self._shutdown_started = False
        self._rpc_lock = threading.Lock()
        self._call_id = 0
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._death_writers: list[Connection] = []
        self._queues: list[MessageQueueOwner | QueueEndpoint] = []
        self._monitor: threading.Thread | None = None
        self._fail_lock = threading.Lock()
        self._ipc_dir: str | None = None
        self._store: Any = None
        self._board: StatusBoard | None = None
        self._liveness_s = float(self.config.worker_liveness_timeout_s)
        # A call that failed on some rank while others may still be running it:
        # (call_id, name, failed rank, when); settled before the next call goes out.
        self._unsettled: tuple[int, str, int, float] | None = None
        self._checked_calls: set[int] = set()  # ids of calls the liveness check judges
        self._pending: deque[_StepFuture] = deque()  # steps sent ahead, oldest first
        try:
            check_shm_space(self.config, self.world_size)
            method = os.environ.get("TP_WORKER_MULTIPROC_METHOD", "forkserver")
            self._ipc_dir = private_dir(method)
            if method == "forkserver":
                # Before the store's and the queues' threads exist: see the module.
                start_forked_forkserver(_FORKSERVER_PRELOAD, self.config.device_config.device_type)
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        start = time.perf_counter()
        ws = self.world_size
        # The rendezvous: a TCPStore served here on loopback, on a port the kernel picks
        # (no race for a free port, no store file to leave behind). Workers only connect.
        self._store = _loopback_store()
        init_method = f"tcpstore://127.0.0.1:{self._store.port}"
        self._board = StatusBoard(ws)
        # Each queue is recorded as soon as it exists, so a failure part-way still releases it.
        mq = dict(max_chunk_bytes=_MQ_CHUNK_BYTES, max_chunks=_MQ_CHUNKS, ipc_dir=self._ipc_dir)
        self._broadcast_owner = self._track(MessageQueueOwner(ws, **mq))
        self._reply_owners = [self._track(MessageQueueOwner(1, **mq)) for _ in range(ws)]
        self._broadcast = self._track(MessageQueueWriter(self._broadcast_owner.export_handle()))
        spin_s = None if self._engine_may_spin() else 0.0
        self._replies = [self._track(MessageQueueReader(q.export_handle(), 0, spin_s=spin_s))
                         for q in self._reply_owners]

        ctx = _mp_context()
        env = {k: v for k, v in os.environ.items() if k.startswith("TP_")}
        assert self._ipc_dir is not None
        ready_readers: list[Connection] = []
        for rank in range(ws):
            ready_r, ready_w = ctx.Pipe(duplex=False)
            death_r, death_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=WorkerProc.worker_main,
                name=f"WorkerProc-TP{rank}",
                args=(self.config, rank, rank, init_method, self._broadcast_owner.export_handle(),
                      self._reply_owners[rank].export_handle(), ready_w, death_r, self._ipc_dir, self._board.name,
                      env),
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
        self._board.unlink()
        self.startup_timings["startup_total"] = time.perf_counter() - start
        self._monitor = threading.Thread(target=self._monitor_workers, name="worker-monitor", daemon=True)
        self._monitor.start()

    def _engine_may_spin(self) -> bool:
        """Whether this process may busy-wait for replies: not on a CPU host whose cores
        all run ranks (cpu_threads_bind "auto" uses every core, "none" lets each rank
        use them all), where a spin, while the ranks run a step of tens of ms, only
        takes time from the rank on the same core. A core left to no rank, or a GPU
        device, keeps the short spin that saves a wake-up per call."""
        device = self.config.device_config
        if device.device_type != "cpu":
            return True
        return bool(spare_cpus(device.cpu_threads_bind, self.world_size, allowed_cpus()))

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
        while not self._shutdown_started and self._failure is None:
            died = wait(list(sentinels), timeout=_MONITOR_POLL_S)
            if self._shutdown_started or self._failure is not None:
                return
            if died:
                self._fail(self._death_message(sentinels[died[0]], "unexpectedly"))
                return
            hung = self._find_hung_rank()
            if hung is not None:
                self._fail(hung)
                return

    def _fail(self, reason: str) -> None:
        """Mark the executor dead for `reason` (the first reason wins), wake every caller
        blocked on a reply (it raises EngineDeadError now) and SIGKILL the workers: a
        group with a dead, hung or out-of-step rank can run nothing more, and its other
        ranks would otherwise spin in a collective until shutdown."""
        with self._fail_lock:
            if self._failure is not None:
                return
            self._failure = reason
        logger.error("%s; the executor is dead", reason)
        for queue in self._replies:
            queue.shutdown()
        for proc in self.processes:
            if proc.exitcode is None:
                try:
                    proc.kill()
                except (OSError, ValueError):
                    pass  # already gone

    def _find_hung_rank(self) -> str | None:
        """The liveness verdict on the board, or None while every rank looks alive."""
        limit = self._liveness_s
        if not limit or self._board is None:
            return None
        now = time.monotonic()
        for rank in range(self.world_size):
            row = self._board.row(rank)
            pid = int(row[liveness.PID])
            beat = row[liveness.HEARTBEAT]
            if beat and now - beat > limit:
                return (f"worker rank {rank} (pid {pid}) sent no heartbeat for {now - beat:.1f}s "
                        f"(worker_liveness_timeout_s={limit:g}): its process is stopped or frozen")
            call = int(row[liveness.BUSY_CALL])
            if (call and call in self._checked_calls and not row[liveness.IN_COLLECTIVE]
                    and now - row[liveness.PROGRESS] > limit):
                return (f"worker rank {rank} (pid {pid}) is hung: busy in a step for {now - row[liveness.BUSY_SINCE]:.1f}s "
                        f"with no progress for {now - row[liveness.PROGRESS]:.1f}s (its main thread used no CPU "
                        f"and entered no collective; worker_liveness_timeout_s={limit:g})")
        return None

    def check_health(self) -> None:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self._shutdown_started:
            raise EngineDeadError("the executor has been shut down")
        if self._unsettled is not None:
            self._settle(wait=False)

    def _note_failure(self, call_id: int, name: str, rank: int) -> None:
        """Rank `rank` failed in `call_id`: remember it if another rank has not finished it."""
        if self._board is None:
            return
        if any(self._board.row(r)[liveness.DONE_CALL] < call_id for r in range(self.world_size)):
            self._unsettled = (call_id, name, rank, time.monotonic())

    def _settle(self, wait: bool = True) -> None:
        """Before the next call: every rank must have finished the failed call. Waits while
        a rank still runs it and makes progress (with `wait`); fails the executor when
        each rank still in it is stuck (waiting in a collective, or no progress, for
        _SETTLE_GRACE_S), since the failed rank will never join that collective."""
        assert self._unsettled is not None and self._board is not None
        call_id, name, failed_rank, failed_at = self._unsettled
        while True:
            if self._failure is not None:
                raise EngineDeadError(self._failure)
            now = time.monotonic()
            pending = [r for r in range(self.world_size) if self._board.row(r)[liveness.DONE_CALL] < call_id]
            if not pending:
                self._unsettled = None
                return
            stuck = []
            for r in pending:
                row = self._board.row(r)
                entered = row[liveness.IN_COLLECTIVE]
                silent = now - row[liveness.PROGRESS]
                # Or in a step sent before it, whose failure elsewhere made this one fail.
                in_failed_call = 0 < int(row[liveness.BUSY_CALL]) <= call_id
                if (in_failed_call and ((entered and now - entered > _SETTLE_GRACE_S) or silent > _SETTLE_GRACE_S)) \
                        or (self._liveness_s and silent > self._liveness_s):
                    stuck.append(r)
            if len(stuck) == len(pending) and now - failed_at > _SETTLE_GRACE_S:
                self._fail(
                    f"rank(s) {pending} can never finish {name!r} (call {call_id}): rank {failed_rank} failed in it "
                    "while they wait in a collective it left; the ranks are out of step, so the executor is dead"
                )
                raise EngineDeadError(self._failure)
            if not wait:
                return
            time.sleep(0.02)

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
        with self._rpc_lock:
            while self._pending:
                self._collect_oldest_step()
            call = self._send(plan, args, kwargs, unique_reply_rank, timeout)
            return self._receive(call)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """One step on every rank. With `non_block`, the step is sent and a Future of
        its output returned at once; at most two steps should be outstanding (the
        engine's async scheduling keeps one running and one queued)."""
        if not non_block:
            return super().execute_model(scheduler_output)
        plan = plan_call("execute_model", self.output_rank, self.world_size)
        with self._rpc_lock:
            after = self._pending[-1].call.call_id if self._pending else None
            call = self._send(plan, (scheduler_output,), None, self.output_rank, EXECUTE_MODEL_TIMEOUT_S, after)
            future = _StepFuture(self, call)
            self._pending.append(future)
        return future

    def _send(self, plan: CallPlan, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
              reply_rank: int | None, timeout: float | None, after_call: int | None = None) -> _SentCall:
        """Put one call on the broadcast queue (under _rpc_lock), after settling a failed one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._unsettled is not None:
            self._settle()
        self._call_id += 1
        call_id = self._call_id
        request = RPCRequest(call_id, plan.payload, tuple(args), dict(kwargs or {}), reply_rank, after_call)
        checked = plan.name in _LIVENESS_CHECKED
        if checked:
            self._checked_calls.add(call_id)
        self._enqueue(request, deadline, plan.name)
        return _SentCall(call_id, plan, reply_rank, deadline, timeout, checked)

    def _receive(self, call: _SentCall) -> Any:
        """Collect a sent call's replies (under _rpc_lock): collective_rpc's result."""
        results = self._collect_replies(call.plan.ranks, call.call_id, call.plan.name, call.deadline, call.timeout)
        if call.checked:
            self._checked_calls.discard(call.call_id)
        return call.plan.results(results, call.reply_rank)

    def _collect_oldest_step(self) -> None:
        """Collect the oldest step sent ahead into its Future (under _rpc_lock)."""
        future = self._pending.popleft()
        try:
            future.set_result(self._receive(future.call))
        except BaseException as e:  # noqa: BLE001 - its owner gets it from the future
            future.set_exception(e)
            if not isinstance(e, Exception):
                raise  # an interrupt still stops this thread

    def _collect_through(self, future: _StepFuture) -> None:
        """Collect steps sent ahead, oldest first, until `future` is done."""
        with self._rpc_lock:
            while not future.done() and self._pending:
                self._collect_oldest_step()

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
                results[rank] = self._result_of(reply, name, call_id)
                waiting.remove(rank)
                continue
            if self._unsettled is not None:
                # An earlier step failed on some rank while this one was queued behind it:
                # a rank waiting in this one's collectives for the failed rank never returns.
                self._settle(wait=False)
            for other in range(self.world_size):
                if other == rank or other in results:
                    continue
                early = self._next_reply(other, call_id, 0.0)
                if early is not None:
                    # Only a failure arrives from a rank that was not asked.
                    results[other] = self._result_of(early, name, call_id)
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

    def _result_of(self, reply: RPCReply, name: str, call_id: int) -> Any:
        if not reply.ok:
            # A peer of a rank that just died may report the death (a collective that
            # saw it) before the monitor does: the death is the cause, say so.
            for rank, proc in enumerate(self.processes):
                if not _pid_alive(proc.pid):
                    self._fail(self._death_message(rank, "unexpectedly"))
                    raise EngineDeadError(self._failure)
            self._note_failure(call_id, name, reply.rank)
            raise RemoteWorkerError(reply.rank, name, reply.error or "", reply.traceback or "")
        return reply.result

    def shutdown(self) -> None:
        """Ask the workers to stop, close the death pipes, then SIGKILL whatever is left
        after the grace period; release every queue, segment and socket, and the store."""
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
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=2 * _MONITOR_POLL_S + 1.0)
        for queue in self._queues:
            queue.shutdown()
        if self._board is not None:
            self._board.close()
        self._store = None  # closes its listening socket
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
