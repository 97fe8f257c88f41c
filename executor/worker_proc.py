"""WorkerProc: the body of one worker process (one TP rank).

Started by MultiprocExecutor. In order: arm the parent-death signal and the death-pipe
watcher, take the engine's TP_* environment, map the liveness board (heartbeat thread;
see executor/liveness.py), attach to the broadcast queue (reader) and to this rank's
reply queue (writer), build the Worker, init_device() (its collectives then report to
the board), load_model(), report READY (or FAILED with the traceback) over the ready
pipe, then serve RPCs until told to stop, marking each call's start and end on the board. A worker
exception is sent back as a reply and the loop goes on (a step queued behind the failed
one, `after_call`, is answered with a failure, not run); only the death of the engine,
a SHUTDOWN message or a signal ends the process.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from tqdm import tqdm

from distributed.parallel_state import observe_collectives
from executor.liveness import WorkerStatus
from executor.message_queue import MessageQueueHandle, QueueClosedError
from executor.message_queue_reader import MessageQueueReader
from executor.message_queue_writer import MessageQueueWriter
from executor.parent_death import set_parent_death_signal
from executor.rpc import GRAMMAR_BITMASK, SHUTDOWN, ReadyMessage, RPCReply, RPCRequest, run_method
from worker.worker import Worker

if TYPE_CHECKING:
    from config import EngineConfig

# How long a rank busy-waits for its next call before it sleeps. With async scheduling
# the next step is usually queued already; without, it comes about 1 ms after a rank's
# reply (the engine takes it in and schedules); a rank that slept by then wakes later
# than one that spun, and its peers wait for it at the step's first collective (TP=2
# bf16 offline: +4% throughput against a 0.5 ms spin here, in two interleaved runs).
# The spin yields its core at every turn, so the engine, if it runs there, is not held up.
NEXT_CALL_SPIN_S = 2e-3


def _watch_death_pipe(death_conn: Connection, ipc_dir: str) -> None:
    """EOF on the death pipe means the engine closed it (shutdown) or died: leave now.
    os._exit skips interpreter teardown, which could block on a half-dead group.

    A dead engine cannot remove its private directory (socket files), so every rank
    tries (the forkserver removes it too, see below); on a normal shutdown the engine has
    no more use for it either."""
    try:
        death_conn.recv()
    except (EOFError, OSError):
        pass
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(0)


def _arm_forkserver_cleanup() -> None:
    """In the forkserver only (it imports this module as a preload): when it exits, which
    it does as soon as the engine that started it is gone, remove that engine's
    multiprocessing temp dir (pymp-*: the forkserver's socket and the engines' private
    directories), as the engine's own clean exit would have; and ignore SIGTERM, so a
    SIGTERM sent to the whole process group still leaves it the moment to do so. A dead
    engine otherwise left a pymp-* directory behind every time."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None and frame.f_code is not forkserver.main.__code__:
        frame = frame.f_back
    if frame is None:
        return  # not the forkserver (the engine, a worker, a script importing us)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    atexit.register(remove_engine_temp_dir, os.getpid(), os.getppid())


def remove_engine_temp_dir(forkserver_pid: int, engine_pid: int) -> None:
    """In a forkserver on its way out (stock or forked, executor/forked_forkserver.py):
    remove the multiprocessing temp dir its socket lives in, unless the engine still
    lives and is its parent."""
    from multiprocessing import forkserver

    if os.getpid() != forkserver_pid:
        return  # a forked child that somehow ran atexit
    address = forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]
    if not isinstance(address, str) or not address or address[0] == "\0":
        return
    temp_dir = os.path.dirname(address)
    if not os.path.basename(temp_dir).startswith("pymp-"):
        return
    try:
        os.kill(engine_pid, 0)
        if os.getppid() == engine_pid:
            return  # the engine lives (we stopped for another reason): the dir is still its own
    except ProcessLookupError:
        pass
    shutil.rmtree(temp_dir, ignore_errors=True)


_arm_forkserver_cleanup()


def _adopt_engine_env(env: dict[str, str]) -> None:
    """Make this process's TP_* variables the engine's: the forkserver's environment was
    fixed when it started, possibly before the engine set them."""
    for key in [k for k in os.environ if k.startswith("TP_") and k not in env]:
        del os.environ[key]
    os.environ.update(env)


class WorkerProc:
    def __init__(self, config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str | None,
                 broadcast_handle: MessageQueueHandle, reply_handle: MessageQueueHandle,
                 status_board: str | None = None) -> None:
        self.rank = rank
        # First: the engine reads liveness (heartbeat, progress) off this from now on.
        self.status = (WorkerStatus(status_board, config.parallel_config.world_size, rank)
                       if status_board is not None else None)
        self.broadcast = MessageQueueReader(broadcast_handle, rank, spin_s=NEXT_CALL_SPIN_S)
        self.reply = MessageQueueWriter(reply_handle)
        self.worker = Worker(config, local_rank=local_rank, rank=rank, distributed_init_method=distributed_init_method)
        self.worker.init_device()
        self._current_call = 0  # the call being run (a grammar message names its step)
        self._stopping = False  # SHUTDOWN came while a step waited for its grammar bitmask
        assert self.worker.model_runner is not None
        self.worker.model_runner.grammar_source = self._receive_grammar
        if self.status is not None:
            observe_collectives(self.status.enter_collective, self.status.exit_collective)
        self.worker.load_model()

    @staticmethod
    def worker_main(config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str | None,
                    broadcast_handle: MessageQueueHandle, reply_handle: MessageQueueHandle,
                    ready_conn: Connection, death_conn: Connection, ipc_dir: str, status_board: str | None = None,
                    env: dict[str, str] | None = None) -> None:
        """Process entry point (the multiprocessing target)."""
        # SIGKILLed when the engine dies, even by SIGKILL; elsewhere the death pipe alone covers it.
        set_parent_death_signal(signal.SIGKILL)
        if env is not None:
            _adopt_engine_env(env)
        # Ctrl-C, and a SIGTERM sent to the whole process group (systemd, `timeout`),
        # reach us too; the engine owns our lifetime and stops us itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # tqdm's default lock is a multiprocessing semaphore that a worker ending in
        # os._exit would leak to the resource tracker; one process needs only a thread lock.
        tqdm.set_lock(threading.RLock())
        threading.Thread(target=_watch_death_pipe, args=(death_conn, ipc_dir), name="death-pipe", daemon=True).start()
        try:
            proc = WorkerProc(config, rank, local_rank, distributed_init_method, broadcast_handle, reply_handle,
                              status_board)
            proc.reply.wait_until_ready(timeout=60)
        except BaseException as e:
            ready_conn.send(ReadyMessage(rank, False, os.getpid(), error=f"{type(e).__name__}: {e}",
                                         traceback=traceback.format_exc()))
            ready_conn.close()
            os._exit(1)
        ready_conn.send(ReadyMessage(rank, True, os.getpid(), timings=proc.worker.get_timings()))
        ready_conn.close()
        # Everything allocated so far lives as long as the worker; keeping it out of the
        # collector's generations spares every later RPC a full-heap pass.
        gc.collect()
        gc.freeze()
        proc.busy_loop()
        proc.close()

    def busy_loop(self) -> None:
        """Serve calls until SHUTDOWN or the queue closes. A request that does not decode
        (``MessageDecodeError``) ends the process with its traceback: its call id is
        unknown, so no reply could answer it, and the engine learns of the death at once."""
        failed_call = 0  # the latest call that failed here
        while True:
            try:
                request: RPCRequest = self.broadcast.dequeue()
            except QueueClosedError:
                return
            if request.method == SHUTDOWN:
                return
            if request.method == GRAMMAR_BITMASK:
                continue  # its step failed (or was refused) before it read this
            self._current_call = request.call_id
            must_reply = request.reply_rank is None or request.reply_rank == self.rank
            if self.status is not None:
                self.status.begin_call(request.call_id)
            try:
                if request.after_call is not None and request.after_call == failed_call:
                    # It was planned on that call's result; the engine drops it too.
                    raise RuntimeError(f"not run: call {failed_call}, sent before it, failed on rank {self.rank}")
                result = run_method(self.worker, request.method, request.args, request.kwargs)
                reply = RPCReply(request.call_id, self.rank, True, result=result if must_reply else None)
            except Exception as e:
                failed_call = request.call_id
                reply = RPCReply(request.call_id, self.rank, False, error=f"{type(e).__name__}: {e}",
                                 traceback=traceback.format_exc())
            finally:
                if self.status is not None:
                    self.status.end_call(request.call_id)
            # A rank that is not asked stays silent unless it failed: the engine looks for
            # such failures while it waits (the failed rank's peers may be stuck in a
            # collective), and drains them. Results nobody asked for are never sent.
            if must_reply or not reply.ok:
                try:
                    self.reply.enqueue(reply)
                except Exception as e:  # noqa: BLE001 - the result did not encode; nothing was sent
                    self.reply.enqueue(RPCReply(request.call_id, self.rank, False,
                                                error=f"cannot send the result back: {type(e).__name__}: {e}",
                                                traceback=traceback.format_exc()))
            if self._stopping:
                return

    def _receive_grammar(self) -> bytes:
        """The running step's grammar bitmask: the next broadcast message (the model
        runner's `grammar_source`, on this process's thread inside execute_model).
        Raises RuntimeError when the engine could not make it, or when the next message
        is not it (a protocol error: that message is lost, and the step fails)."""
        request: RPCRequest = self.broadcast.dequeue()
        if request.method == SHUTDOWN:
            self._stopping = True
            raise RuntimeError(f"rank {self.rank}: shut down while a step waited for its grammar bitmask")
        if request.method != GRAMMAR_BITMASK or request.args[0] != self._current_call:
            raise RuntimeError(f"rank {self.rank}: expected the grammar bitmask of call {self._current_call}, "
                               f"got call {request.call_id} ({request.method!r})")
        _, bitmask, error = request.args
        if error is not None:
            raise RuntimeError(f"the engine could not make this step's grammar bitmask: {error}")
        return bitmask

    def close(self) -> None:
        if self.status is not None:
            self.status.close()
        self.worker.shutdown()
        self.broadcast.shutdown()
        self.reply.shutdown()
