"""The engine loop: the one thread that steps an EngineCore for the AsyncEngine
(engine/async_engine.py), as vLLM's EngineCoreProc runs its busy loop.

The core is not thread-safe, so only this thread ever touches it. Other threads hand
it commands through a thread-safe queue (`submit`: add a processed request, abort, a
call on the core, sleep; `stop`); the loop drains the queue, calls `core.step()` while
any request is unfinished, and posts each `RequestOutput` to its request's
`RequestStream` on the consumer's event loop with `loop.call_soon_threadsafe` (one call
per step and event loop, not per token). When idle it blocks on the queue, waking once
per `health_check_interval_s` to check the workers and, the first time after a busy
spell, to have the memory the batches freed handed back (`EngineCore.trim_host_memory`).
It keeps the metrics (engine/request_stats.py) and writes the periodic stats line
(engine/stat_logger.py) unless `log_stats=False`.

Sleep mode: a sleep waits for the running requests to finish (unless it aborts them or
only pauses), the calls that came after it wait for the sleep, in order, and requests
that arrive from a sleep call on wait, not yet accepted, for the wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core import EngineCore
from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput
from engine.processor import EngineCoreRequest
from engine.request_stats import RequestStatsTracker
from engine.request_stream import ACCEPTED, EngineShutdownError, RequestAbortedError, RequestStream, deliver
from engine.stat_logger import LoggingStatLogger
from executor.errors import EngineDeadError

logger = logging.getLogger(__name__)


@dataclass
class AddCommand:
    stream: RequestStream
    request: EngineCoreRequest


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class UtilityCommand:
    """`fn(core)`, run between steps; its result or exception resolves `future` on `loop`."""

    fn: Callable[[EngineCore], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class SleepCommand:
    level: int
    abort: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


_SHUTDOWN = object()


def _resolve(future: asyncio.Future, result: object) -> None:
    if future.done():  # the caller was cancelled
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


class EngineLoop:
    """Starts the thread at construction. `submit`, `abort` and `stop` may be called
    from any thread; every other method runs on the loop's own thread."""

    def __init__(self, core: EngineCore, metrics: EngineMetrics, health_check_interval_s: float,
                 log_stats: bool) -> None:
        self.core = core
        self.metrics = metrics
        self._stats = RequestStatsTracker(metrics)
        device = core.config.device_config.device_type
        self._stat_logger = LoggingStatLogger(metrics, device_type=device) if log_stats else None
        self.dead_event = threading.Event()  # set once the engine died (not at a clean shutdown)
        self._health_check_interval_s = health_check_interval_s
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against the loop's exit
        self._accepting = True
        self.dead_error: EngineDeadError | None = None  # written under _lock
        self.stopping = False  # stop() was called; written under _lock
        # Engine-loop thread state:
        self._streams: dict[str, RequestStream] = {}
        self._held: list[SleepCommand | UtilityCommand] = []
        self._deferred: list[AddCommand] = []
        self.sleeping = False  # from a sleep command until everything is awake; read by any thread
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------- any thread

    def submit(self, command: object) -> None:
        """Queue a command. Raises EngineDeadError when the engine died,
        EngineShutdownError once it is shutting down."""
        with self._lock:
            if self.dead_error is not None:
                raise EngineDeadError(str(self.dead_error))
            if not self._accepting:
                raise EngineShutdownError("the engine is shutting down; request refused")
            self._commands.put(command)

    def abort(self, request_id: str) -> None:
        """Abort a request; unknown or finished ids, or a stopped loop, are a no-op."""
        with self._lock:
            if self._accepting:
                self._commands.put(AbortCommand(request_id))

    def stop(self, timeout: float) -> bool:
        """Fail whatever is pending with EngineShutdownError and end the thread (waiting
        at most `timeout` seconds). False if it was stopped before."""
        with self._lock:
            if self.stopping:
                return False
            self.stopping = True
            self._commands.put(_SHUTDOWN)  # harmless if the loop has already exited
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.0fs; shutting the core down under it", timeout)
        return True

    # ------------------------------------------------------- the loop's thread

    def _run(self) -> None:
        try:
            while True:
                idle = not self.core.has_unfinished_requests() or self.core.is_sleeping
                if not self._process_commands(block=idle and not self._held):
                    self._stop_accepting(EngineShutdownError("the engine was shut down before the request finished"),
                                         abort_in_core=True)
                    return
                if self._held:
                    self._run_held()
                if self.core.has_unfinished_requests() and not self.core.is_sleeping:
                    self._step()
                self._flush()
                if self._stat_logger is not None:
                    self._stat_logger.maybe_log()
        except BaseException as e:  # noqa: BLE001 - any loop failure kills the engine
            with self._lock:
                stopping = self.stopping
            if stopping:
                # stop() gave up waiting and the core was shut down under us: not a death.
                self._stop_accepting(EngineShutdownError("the engine was shut down before the request finished"),
                                     abort_in_core=False)
                return
            if isinstance(e, EngineDeadError):
                error = e
            else:
                logger.exception("the engine loop failed")
                error = EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}")
                error.__cause__ = e
            logger.error("engine is dead: %s", error)
            with self._lock:
                self.dead_error = error
            self.metrics.set_healthy(False)
            self._stop_accepting(error, abort_in_core=False)
            self.dead_event.set()

    def _process_commands(self, block: bool) -> bool:
        """Handle every queued command; False once told to shut down."""
        try:
            if block:
                command = self._commands.get(timeout=self._health_check_interval_s)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            if block:
                self.core.check_health()  # raises EngineDeadError when a worker died while idle
                self.core.trim_host_memory()  # idle a whole interval: what the last batches freed goes back
            return True
        while True:
            if command is _SHUTDOWN:
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._stats.update_gauges(self.core)
                return True

    def _run_held(self) -> None:
        """Run the held commands in order; a sleep first lets the running requests
        finish (unless it aborts them or only pauses)."""
        while self._held:
            command = self._held[0]
            if isinstance(command, UtilityCommand):
                self._held.pop(0)
                self._call(command)
                continue
            if not command.abort and command.level > 0 and self.core.has_unfinished_requests():
                return
            self._held.pop(0)
            try:
                result: object = self.core.sleep(command.level, abort=command.abort)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                result = e
                self._resume_if_awake()  # a sleep that failed must not hold new requests back
            self._deliver(self.core.step())  # what finished on the way: aborted requests' last outputs
            command.loop.call_soon_threadsafe(_resolve, command.future, result)

    def _call(self, command: UtilityCommand) -> None:
        try:
            result: object = command.fn(self.core)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the core is unchanged
            result = e
        command.loop.call_soon_threadsafe(_resolve, command.future, result)

    def wake_up(self, tags: Sequence[str] | None) -> list[dict[str, Any]]:
        """EngineCore.wake_up, then accept the requests that waited once all is awake.
        Runs on the loop's thread, as a UtilityCommand's function."""
        reports = self.core.wake_up(tags)
        self._resume_if_awake()
        return reports

    def _resume_if_awake(self) -> None:
        """Once the core is awake and no sleep is pending, accept the requests that waited."""
        if not self.core.is_sleeping and not any(isinstance(c, SleepCommand) for c in self._held):
            self.sleeping = False
            deferred, self._deferred = self._deferred, []
            for command in deferred:
                self._handle(command)

    def _handle(self, command: object) -> None:
        if isinstance(command, SleepCommand):
            self.sleeping = True
            self._held.append(command)
        elif isinstance(command, UtilityCommand) and self._held:
            self._held.append(command)
        elif isinstance(command, AddCommand) and self.sleeping:
            self._deferred.append(command)
        elif isinstance(command, AddCommand):
            self._add(command)
        elif isinstance(command, UtilityCommand):
            self._call(command)
        elif isinstance(command, AbortCommand):
            self.core.abort_request(command.request_id)
            aborted = self._streams.pop(command.request_id, None)
            if aborted is not None:
                self._stats.on_aborted(command.request_id, time.monotonic())
                self._post(aborted, RequestAbortedError(f"request {command.request_id} was aborted"))

    def _add(self, command: AddCommand) -> None:
        """Queue a processed request in the core (not validated again), or post the
        core's refusal (ValueError: a prompt the scheduler cannot hold, a duplicate id)."""
        stream, request = command.stream, command.request
        try:
            self.core.add_request(request)
        except Exception as e:  # noqa: BLE001 - refused; the core is unchanged
            if not isinstance(e, ValueError):
                logger.exception("add_request(%s) failed", stream.request_id)
            self._post(stream, e)
            return
        self._streams[stream.request_id] = stream
        self._stats.on_request_added(request, stream.deltas)
        self._post(stream, ACCEPTED)

    def _step(self) -> None:
        start, started = time.perf_counter(), time.monotonic()
        outputs = self.core.step()
        seconds = time.perf_counter() - start
        self._stats.on_scheduled(self.core.scheduler, started)
        num_new_tokens = self._deliver(outputs, started)
        self.metrics.on_step(seconds, num_new_tokens, self.core.last_step_num_tokens)

    def _deliver(self, outputs: list[RequestOutput], step_started: float | None = None) -> int:
        """Hand each output to its stream and record its metrics; returns how many new
        tokens they brought."""
        now = time.monotonic()
        num_new_tokens = 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            num_new_tokens += self._stats.on_output(output, now, step_started)
            if output.finished:
                del self._streams[output.request_id]
            self._post(stream, output)
        self._stats.update_gauges(self.core)
        return num_new_tokens

    def _stop_accepting(self, error: EngineDeadError, abort_in_core: bool) -> None:
        """Refuse new work and fail every pending request (and queued add) with `error`."""
        with self._lock:
            self._accepting = False
        for request_id, stream in self._streams.items():
            if abort_in_core:
                self.core.abort_request(request_id)
            self._stats.on_failed(request_id)
            self._post(stream, type(error)(str(error)))
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AddCommand):
                self._post(command.stream, type(error)(str(error)))
            elif isinstance(command, (UtilityCommand, SleepCommand)):
                command.loop.call_soon_threadsafe(_resolve, command.future, type(error)(str(error)))
        for add in self._deferred:
            self._post(add.stream, type(error)(str(error)))
        self._deferred.clear()
        for held in self._held:
            held.loop.call_soon_threadsafe(_resolve, held.future, type(error)(str(error)))
        self._held.clear()
        self._flush()

    def _post(self, stream: RequestStream, item: object) -> None:
        self._outbox.setdefault(stream.loop, []).append((stream, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:
                pass  # that event loop is closed: its consumers are gone
