"""MultiprocExecutor: one WorkerProc per TP rank, driven over shared memory.

Start-up, on the engine's thread: check the host (executor/host_resources.py: /dev/shm
space, a private socket directory, the forkserver, a loopback TCPStore), create the
queues and the liveness board, start every rank and wait for all READY messages
(executor/worker_proc_handle.py: a rank that fails or dies first makes the whole start
fail, with its traceback, and nothing left running). Then the shm names are unlinked
(everyone has mapped them, so no crash can leak a segment) and the worker monitor
(executor/worker_monitor.py) starts: any rank dying, stopping its heartbeat, hanging in
a step, or left out of step by a peer's failure marks the executor failed, SIGKILLs its
workers and cancels pending calls; every pending and later call raises EngineDeadError
at once. A call that failed on one rank while another still runs it is settled before
the next call is sent.

The call pipeline: calls go out on one broadcast queue, in id order, under `_rpc_lock`;
each rank answers on its own reply queue. While one rank's reply is awaited, the other
queues are checked for an early failure, so a rank that failed (and left its peers
blocked in a collective) is reported at once, by name.

Async scheduling: `execute_model(non_block=True)` sends the step and returns a Future
at once, so the engine plans step N+1 while the ranks run step N and sends it before
N's result is back; each rank starts N+1 the moment it finishes N. Replies are
collected in the order the calls were sent: when a Future's result is asked for, or
before any other call goes out (so a collective_rpc never overtakes a step). A step
sent behind another names it (`after_call`): a rank on which the earlier step failed
answers the later one with a failure instead of running it, and a rank left waiting in
its collectives is found stuck by the settle check. A step whose grammar bitmask follows
it (structured outputs) gets it as one more broadcast message (`send_grammar_bitmask`),
which the ranks read inside the step, after its forward.

Shutdown asks the workers to stop, closes the death pipes, SIGKILLs what is left after
a grace period, and removes the private directory.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from executor.abstract import EXECUTE_MODEL_TIMEOUT_S, Executor
from executor.errors import EngineDeadError, RemoteWorkerError
from executor.forked_forkserver import start_forked_forkserver
from executor.host_resources import (
    FORKSERVER_PRELOAD,
    MQ_CHUNK_BYTES,
    MQ_CHUNKS,
    check_shm_space,
    engine_may_spin,
    get_mp_context,
    loopback_store,
    private_dir,
)
from executor.liveness import StatusBoard
from executor.message_queue import MessageQueueOwner, QueueClosedError, QueueEndpoint
from executor.message_queue_reader import MessageQueueReader
from executor.message_queue_writer import MessageQueueWriter
from executor.rpc import GRAMMAR_BITMASK, SHUTDOWN, CallPlan, RPCMethod, RPCReply, RPCRequest, plan_call
from executor.serial_utils import MessageDecodeError
from executor.worker_monitor import WorkerMonitor
from executor.worker_proc_handle import WorkerProcHandle, make_worker_process, wait_for_ready

if TYPE_CHECKING:
    from worker.outputs import ModelRunnerOutput, SchedulerOutput

SHUTDOWN_GRACE_S = 5.0
# While one rank's reply is awaited, the other ranks' queues are checked for an early
# failure this often.
_ERROR_POLL_S = 0.1
# Calls whose silence the liveness check judges (a user's callable may sleep at will).
_LIVENESS_CHECKED = frozenset({"execute_model", "check_health"})

_Q = TypeVar("_Q", bound="MessageQueueOwner | QueueEndpoint")


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
    """One WorkerProc per TP rank (see the module). Calls are sent, and their replies
    collected, under `_rpc_lock` by the engine's thread (or by the thread that asks a
    step's Future for its result); `check_health` may be called from any thread."""

    supports_async_scheduling = True
    supports_grammar_overlap = True

    def _init_executor(self) -> None:
        self._shutdown_started = False
        self._rpc_lock = threading.Lock()
        self._call_id = 0
        self.workers: list[WorkerProcHandle] = []  # every rank started, ready or not
        self._queues: list[MessageQueueOwner | QueueEndpoint] = []
        self._replies: list[MessageQueueReader] = []
        self._monitor: WorkerMonitor | None = None  # once every rank is ready
        self._ipc_dir: str | None = None
        self._store: Any = None
        self._board: StatusBoard | None = None
        self._pending: deque[_StepFuture] = deque()  # steps sent ahead, oldest first
        try:
            check_shm_space(self.config, self.world_size)
            method = os.environ.get("TP_WORKER_MULTIPROC_METHOD", "forkserver")
            self._ipc_dir = private_dir(method)
            if method == "forkserver":
                # Before the store's and the queues' threads exist (forked_forkserver.py).
                start_forked_forkserver(FORKSERVER_PRELOAD, self.config.device_config.device_type)
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker processes, in rank order."""
        return [w.proc for w in self.workers]

    @property
    def monitor(self) -> WorkerMonitor:
        """The ready group's monitor (failure state, liveness verdicts). Every call goes
        out after start-up, when it exists."""
        assert self._monitor is not None, "the workers are not ready"
        return self._monitor

    def _start_workers(self) -> None:
        start = time.perf_counter()
        ws = self.world_size
        # The rendezvous: a TCPStore served here on loopback, on a port the kernel picks
        # (no race for a free port, no store file to leave behind). Workers only connect.
        self._store = loopback_store()
        init_method = f"tcpstore://127.0.0.1:{self._store.port}"
        self._board = StatusBoard(ws)
        # Each queue is recorded as soon as it exists, so a failure part-way still releases it.
        mq = dict(max_chunk_bytes=MQ_CHUNK_BYTES, max_chunks=MQ_CHUNKS, ipc_dir=self._ipc_dir)
        self._broadcast_owner = self._track(MessageQueueOwner(ws, **mq))
        self._reply_owners = [self._track(MessageQueueOwner(1, **mq)) for _ in range(ws)]
        self._broadcast = self._track(MessageQueueWriter(self._broadcast_owner.export_handle()))
        spin_s = None if engine_may_spin(self.config, self.world_size) else 0.0
        self._replies = [self._track(MessageQueueReader(q.export_handle(), 0, spin_s=spin_s))
                         for q in self._reply_owners]

        ctx = get_mp_context()
        env = {k: v for k, v in os.environ.items() if k.startswith("TP_")}
        assert self._ipc_dir is not None
        unready = []
        for rank in range(ws):
            started = make_worker_process(ctx, self.config, rank, init_method, self._broadcast_owner.export_handle(),
                                          self._reply_owners[rank].export_handle(), self._ipc_dir, self._board.name,
                                          env)
            self.workers.append(started.handle)  # shut down even if a later rank fails to start
            unready.append(started)
        self.startup_timings["spawn"] = time.perf_counter() - start
        wait_for_ready(unready)
        self._broadcast.wait_until_ready(timeout=60)
        for queue in (self._broadcast_owner, *self._reply_owners):
            queue.unlink()
        self._board.unlink()
        self.startup_timings["startup_total"] = time.perf_counter() - start
        self._monitor = WorkerMonitor(self.workers, self._board, float(self.config.worker_liveness_timeout_s),
                                      on_fail=self._wake_callers)
        self._monitor.start()

    def _track(self, queue: _Q) -> _Q:
        self._queues.append(queue)
        return queue

    def _wake_callers(self) -> None:
        """The monitor failed the group (any thread): a caller blocked on a reply
        raises EngineDeadError now, not at its deadline."""
        for queue in self._replies:
            queue.shutdown()

    def check_health(self) -> None:
        """Raise EngineDeadError if the group failed or was shut down. Any thread (the
        /health route calls it on the server's event loop) and it never blocks: a call
        that failed on one rank is settled here only if no other thread is settling it,
        with one look at the board (`WorkerMonitor.settle(wait=False)`)."""
        monitor = self._monitor
        if monitor is not None:  # None only when start-up failed (and shut down)
            monitor.raise_if_failed()
        if self._shutdown_started or monitor is None:
            raise EngineDeadError("the executor has been shut down")
        monitor.settle(wait=False)

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

    def send_grammar_bitmask(self, step: Future, bitmask: bytes | None, error: str | None = None) -> None:
        """The grammar bitmask of `step` as the next broadcast message, which each rank
        reads inside that step just before it samples (or `error`, which fails the step
        there); never answered. The engine sends it once per `grammar_follows` step,
        before it sends anything that would collect that step."""
        assert isinstance(step, _StepFuture)
        with self._rpc_lock:
            self._call_id += 1
            request = RPCRequest(self._call_id, GRAMMAR_BITMASK, (step.call.call_id, bitmask, error))
            self._enqueue(request, step.call.deadline, "grammar_bitmask")

    def _send(self, plan: CallPlan, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
              reply_rank: int | None, timeout: float | None, after_call: int | None = None) -> _SentCall:
        """Put one call on the broadcast queue (under _rpc_lock), after settling a failed one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.monitor.settle()
        self._call_id += 1
        call_id = self._call_id
        request = RPCRequest(call_id, plan.payload, tuple(args), dict(kwargs or {}), reply_rank, after_call)
        checked = plan.name in _LIVENESS_CHECKED
        if checked:
            self.monitor.checked_calls.add(call_id)
        self._enqueue(request, deadline, plan.name)
        return _SentCall(call_id, plan, reply_rank, deadline, timeout, checked)

    def _receive(self, call: _SentCall) -> Any:
        """Collect a sent call's replies (under _rpc_lock): collective_rpc's result."""
        results = self._collect_replies(call.plan.ranks, call.call_id, call.plan.name, call.deadline, call.timeout)
        if call.checked:
            self.monitor.checked_calls.discard(call.call_id)
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
            # An earlier step may have failed on some rank while this one was queued behind
            # it: a rank waiting in this one's collectives for the failed rank never returns.
            self.monitor.settle(wait=False)
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
            except MessageDecodeError as e:
                # The ring's bytes are not a message: the group can no longer be trusted.
                self.monitor.fail(f"rank {rank}'s reply does not decode: {e}")
                raise EngineDeadError(self.monitor.failure) from e
            if reply.call_id == call_id:
                return reply

    def _result_of(self, reply: RPCReply, name: str, call_id: int) -> Any:
        if not reply.ok:
            self.monitor.fail_if_a_rank_died()
            self.monitor.note_failure(call_id, name, reply.rank)
            raise RemoteWorkerError(reply.rank, name, reply.error or "", reply.traceback or "")
        return reply.result

    def shutdown(self) -> None:
        """Ask the workers to stop, close the death pipes, then SIGKILL whatever is left
        after the grace period; release every queue, segment and socket, and the store."""
        if self._shutdown_started:
            return
        self._shutdown_started = True
        if self._monitor is not None:
            self._monitor.stop()
        failed = self._monitor is not None and self._monitor.failure is not None
        if not failed and getattr(self, "_broadcast", None) is not None and self.workers:
            try:
                self._broadcast.enqueue(RPCRequest(-1, SHUTDOWN), timeout=1.0)
            except Exception:  # noqa: BLE001 - best effort; the pipes and signals follow
                pass
        for worker in self.workers:
            worker.death_writer.close()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        # Workers ignore SIGTERM (see WorkerProc), so one still alive now gets SIGKILL.
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()
        for proc in self.processes:
            proc.join()
        if self._monitor is not None:
            self._monitor.join()
        for queue in self._queues:
            queue.shutdown()
        if self._board is not None:
            self._board.close()
        self._store = None  # closes its listening socket
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
