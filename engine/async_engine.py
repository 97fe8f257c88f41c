"""AsyncEngine: an EngineCore driven by one background thread, consumed from asyncio.

The core is not thread-safe, so exactly one thread, the engine loop, ever touches it.
Callers hand it work through a thread-safe command queue (add, abort, a call on the
core such as reset_prefix_cache, shutdown); the loop drains that queue, calls
`core.step()` while any request is unfinished, and hands each `RequestOutput` to its
request's `RequestStream` on the consumer's event loop with `loop.call_soon_threadsafe`
(one call per step and loop, not per token). When idle the loop blocks on the queue,
waking once per `health_check_interval_s` to check the workers. It also writes the
periodic stats line (engine/stat_logger.py) unless `log_stats=False`.

Every accepted request ends in exactly one of: a finished output, an error raised from
its stream (`EngineDeadError` when a worker died, `EngineShutdownError` at shutdown), or
an abort that its own consumer asked for. A request submitted after the loop stopped is
refused at once. Outputs are cumulative, so a slow consumer simply skips to the newest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from config import RequestOutputKind, SamplingParams
from engine.core import EngineCore
from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput
from engine.stat_logger import LoggingStatLogger
from executor.errors import EngineDeadError

logger = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 1.0


class EngineShutdownError(EngineDeadError):
    """The engine was shut down while the request was pending, or before it arrived."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by someone other than its consumer."""


_ACCEPTED = object()  # posted to a stream once the core took the request


class RequestStream:
    """The outputs of one request, consumed by `async for` on the loop that created it.

    Each item is the newest cumulative `RequestOutput`; the last has `finished=True`.
    An engine failure is raised from the iteration. `done` turns True once nothing more
    will come; a consumer that stops earlier must abort the request (as `generate` does).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.done = False
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = loop.create_future()
        # Owned by the engine-loop thread (the request's timeline, for the metrics):
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens_seen = 0  # of the first sample: the request's timeline and histograms
        self.num_sample_tokens_seen = 0  # of every sample: generation_tokens_total
        # Its outputs carry only what is new (RequestOutputKind.DELTA); set by the engine
        # thread before it posts the first one.
        self.deltas = False
        self.num_preemptions = 0

    def _receive(self, item: object) -> None:
        """On the consumer's loop: take one item posted by the engine thread."""
        if not self._accepted.done():
            if item is _ACCEPTED:
                self._accepted.set_result(None)
            elif isinstance(item, BaseException):
                self._accepted.set_exception(item)
            return
        if item is not _ACCEPTED:
            self._queue.put_nowait(item)  # type: ignore[arg-type]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        # A cumulative output holds every one before it: skip straight to the newest one
        # queued. A DELTA output holds only its own tokens, so each is given in turn.
        while (not self.deltas and isinstance(item, RequestOutput) and not item.finished
               and not self._queue.empty()):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item


@dataclass
class _Add:
    stream: RequestStream
    sampling_params: SamplingParams
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _CoreCall:
    fn: Callable[[EngineCore], object]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Sleep:
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


def _deliver(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream._receive(item)


class AsyncEngine:
    """Owns an EngineCore and the single thread that steps it."""

    def __init__(
        self,
        core: EngineCore,
        *,
        metrics: EngineMetrics | None = None,
        health_check_interval_s: float = HEALTH_CHECK_INTERVAL_S,
        log_stats: bool = True,
    ) -> None:
        self.core = core
        self.metrics = metrics or EngineMetrics(core.config.model, core.config.scheduler_config.max_model_len)
        self.metrics.set_cache_config_info(core.cache_config_info())
        device = core.config.device_config.device_type
        self._stat_logger = LoggingStatLogger(self.metrics, device_type=device) if log_stats else None
        self.dead_event = threading.Event()  # set once the engine died (not at a clean shutdown)
        self._health_check_interval_s = health_check_interval_s
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against the loop's exit
        self._accepting = True
        self._dead_error: EngineDeadError | None = None
        self._shutdown_called = False
        # Engine-loop thread state:
        self._streams: dict[str, RequestStream] = {}
        # Sleep mode: a sleep waits for the running requests to finish, and the calls
        # that came after it wait for the sleep (in order); requests that arrive from
        # a sleep call on wait, unaccepted, for the wake-up.
        self._held: list[_Sleep | _CoreCall] = []
        self._deferred: list[_Add] = []
        self._sleeping = False
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ facts

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.config.scheduler_config.max_model_len

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine loop failed or any worker is gone."""
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error))
        if self._shutdown_called:
            raise EngineShutdownError("the engine has been shut down")
        self.core.check_health(restart=False)  # any thread: only the engine loop replaces workers

    # -------------------------------------------------------------- requests

    async def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the core accepted it (see EngineCore.add_request).

        Raises ValueError when the core refuses it (the server turns that into a 400),
        EngineDeadError when the engine is dead or shutting down.
        """
        stream = RequestStream(
            request_id if request_id is not None else f"req-{uuid.uuid4().hex}",
            self.core.to_token_ids(prompt),
            asyncio.get_running_loop(),
        )
        self._submit(_Add(stream, sampling_params or SamplingParams(), cache_salt))
        try:
            await stream._accepted
        except asyncio.CancelledError:
            self.abort(stream.request_id)  # it may have been accepted meanwhile
            raise
        return stream

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of one request, as its `output_kind` asks; the last has
        `finished=True`. Cumulative ones (the default) that queue up while the caller is
        busy are skipped to the newest; DELTA ones all come, in order. Leaving the loop
        early (break, cancellation, client disconnect) aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.done:
                self.abort(stream.request_id)

    @property
    def is_sleeping(self) -> bool:
        """True from a `sleep` call until `wake_up` brought everything back."""
        return self._sleeping

    async def sleep(self, level: int = 1, abort: bool = False) -> list[dict[str, Any]]:
        """EngineCore.sleep on the engine loop. From this call on, new requests wait
        (not yet accepted) until `wake_up`; requests already accepted finish first (at
        level 0 they pause), or with `abort=True` end at once with finish_reason
        "abort". Returns each rank's memory report once asleep."""
        if not self.core.config.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: start the server with --enable-sleep-mode")
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level={level!r} must be 0, 1 or 2")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._submit(_Sleep(level, abort, loop, future))
        return await future

    async def wake_up(self, tags: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """EngineCore.wake_up on the engine loop; once awake, the requests that waited
        are accepted in their order of arrival."""
        return await self._on_loop(lambda core: self._wake_up_on_loop(core, tags))

    async def reset_prefix_cache(self) -> int:
        """Drop every cached KV block (EngineCore.reset_prefix_cache, run on the engine
        loop between steps); returns how many were cached. Raises EngineDeadError."""
        return await self._on_loop(lambda core: core.reset_prefix_cache())

    async def _on_loop(self, fn: Callable[[EngineCore], Any]) -> Any:
        """`fn(core)`'s result (or exception), run by the engine loop between steps."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._submit(_CoreCall(fn, loop, future))
        return await future

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are a no-op."""
        with self._lock:
            if self._accepting:
                self._commands.put(_Abort(request_id))

    def _submit(self, command: object) -> None:
        with self._lock:
            if self._dead_error is not None:
                raise EngineDeadError(str(self._dead_error))
            if not self._accepting:
                raise EngineShutdownError("the engine is shutting down; request refused")
            self._commands.put(command)

    # ------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = 30.0) -> None:
        """Fail whatever is still pending with EngineShutdownError, stop the loop and
        shut the core down. Idempotent; callable from any thread but the loop's."""
        with self._lock:
            if self._shutdown_called:
                return
            self._shutdown_called = True
            self._commands.put(_SHUTDOWN)  # harmless if the loop has already exited
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.0fs; shutting the core down under it", timeout)
        self.core.shutdown()

    # --------------------------------------------------- the engine-loop thread

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
                stopping = self._shutdown_called
            if stopping:
                # shutdown() gave up waiting and stopped the core under us: not a death.
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
                self._dead_error = error
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
            return True
        while True:
            if command is _SHUTDOWN:
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._update_gauges()
                return True

    def _run_held(self) -> None:
        """Run the held commands in order; a sleep first lets the running requests
        finish (unless it aborts them or only pauses)."""
        while self._held:
            command = self._held[0]
            if isinstance(command, _CoreCall):
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

    def _call(self, command: _CoreCall) -> None:
        try:
            result: object = command.fn(self.core)
        except Exception as e:  # noqa: BLE001 - the caller gets it; the core is unchanged
            result = e
        command.loop.call_soon_threadsafe(_resolve, command.future, result)

    def _wake_up_on_loop(self, core: EngineCore, tags: Sequence[str] | None) -> list[dict[str, Any]]:
        reports = core.wake_up(tags)
        self._resume_if_awake()
        return reports

    def _resume_if_awake(self) -> None:
        """Once the core is awake and no sleep is pending, accept the requests that waited."""
        if not self.core.is_sleeping and not any(isinstance(c, _Sleep) for c in self._held):
            self._sleeping = False
            deferred, self._deferred = self._deferred, []
            for command in deferred:
                self._handle(command)

    def _handle(self, command: object) -> None:
        if isinstance(command, _Sleep):
            self._sleeping = True
            self._held.append(command)
        elif isinstance(command, _CoreCall) and self._held:
            self._held.append(command)
        elif isinstance(command, _Add) and self._sleeping:
            self._deferred.append(command)
        elif isinstance(command, _Add):
            stream = command.stream
            try:
                self.core.add_request(stream.prompt_token_ids, command.sampling_params, stream.request_id,
                                      command.cache_salt)
            except Exception as e:  # noqa: BLE001 - refused (ValueError: invalid); the core is unchanged
                if not isinstance(e, ValueError):
                    logger.exception("add_request(%s) failed", stream.request_id)
                self._post(stream, e)
                return
            self._streams[stream.request_id] = stream
            params = command.sampling_params
            stream.deltas = getattr(params, "output_kind", None) is RequestOutputKind.DELTA
            self.metrics.on_request_added(len(stream.prompt_token_ids), params.max_tokens, getattr(params, "n", 1))
            self._post(stream, _ACCEPTED)
        elif isinstance(command, _CoreCall):
            self._call(command)
        elif isinstance(command, _Abort):
            self.core.abort_request(command.request_id)
            aborted = self._streams.pop(command.request_id, None)
            if aborted is not None:
                self._on_finished(aborted, "abort", aborted.num_tokens_seen, time.monotonic())
                self._post(aborted, RequestAbortedError(f"request {command.request_id} was aborted"))

    def _step(self) -> None:
        start, started = time.perf_counter(), time.monotonic()
        outputs = self.core.step()
        seconds = time.perf_counter() - start
        self._track_scheduling(started)
        num_new_tokens = self._deliver(outputs, started)
        self.metrics.on_step(seconds, num_new_tokens, self.core.last_step_num_tokens)

    def _track_scheduling(self, step_started: float) -> None:
        """Metrics: when each request was first scheduled, and its preemptions."""
        scheduler = self.core.scheduler
        for request in scheduler.running:
            stream = self._streams.get(request.request_id)
            if stream is not None and stream.scheduled_time is None:
                stream.scheduled_time = step_started
        for request in scheduler.waiting:  # preempted requests wait again
            stream = self._streams.get(request.request_id)
            if stream is not None and request.num_preemptions > stream.num_preemptions:
                self.metrics.on_preemptions(request.num_preemptions - stream.num_preemptions)
                stream.num_preemptions = request.num_preemptions

    def _deliver(self, outputs: list[RequestOutput], step_started: float | None = None) -> int:
        """Hand each output to its stream and record its metrics; returns how many new
        tokens they brought (a multi-step output brings several per request)."""
        now = time.monotonic()
        num_new_tokens = 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if stream.scheduled_time is None:  # scheduled and done within this step
                stream.scheduled_time = step_started if step_started is not None else now
            num_tokens = len(output.token_ids) + (stream.num_tokens_seen if stream.deltas else 0)
            if num_tokens > stream.num_tokens_seen:
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    self.metrics.on_first_token(now - stream.arrival_time)
                    self.metrics.on_prefilled(len(stream.prompt_token_ids))
                else:
                    self.metrics.on_token(now - (stream.last_token_time or now))
                stream.last_token_time = now
                stream.num_tokens_seen = num_tokens
            # Every sample's tokens count as generated (n > 1), as vLLM counts its child requests'.
            all_tokens = sum(len(sample.token_ids) for sample in output.outputs)
            all_tokens += stream.num_sample_tokens_seen if stream.deltas else 0
            if all_tokens > stream.num_sample_tokens_seen:
                num_new_tokens += all_tokens - stream.num_sample_tokens_seen
                stream.num_sample_tokens_seen = all_tokens
            if output.finished:
                del self._streams[output.request_id]
                self._on_finished(stream, output.finish_reason, stream.num_tokens_seen, now)
            self._post(stream, output)
        self._update_gauges()
        return num_new_tokens

    def _on_finished(self, stream: RequestStream, finish_reason: str | None, num_tokens: int, now: float) -> None:
        """Metrics: a request's end, with vLLM's request phases where they happened."""
        if stream.first_token_time is None and finish_reason != "abort":
            self.metrics.on_prefilled(len(stream.prompt_token_ids))  # scored, nothing generated
        scheduled, first, last = stream.scheduled_time, stream.first_token_time, stream.last_token_time
        self.metrics.on_request_finished(
            finish_reason, now - stream.arrival_time,
            num_prompt_tokens=len(stream.prompt_token_ids), num_generation_tokens=num_tokens,
            queue_seconds=None if scheduled is None else scheduled - stream.arrival_time,
            prefill_seconds=None if scheduled is None or first is None else first - scheduled,
            decode_seconds=None if first is None or last is None else last - first,
            inference_seconds=None if scheduled is None else (last or now) - scheduled,
            num_preemptions=stream.num_preemptions,
        )

    def _update_gauges(self) -> None:
        scheduler = self.core.scheduler
        block_manager = scheduler.block_manager
        self.metrics.set_scheduler_state(len(scheduler.running), len(scheduler.waiting), block_manager.usage)
        self.metrics.set_prefix_cache_totals(block_manager.stats.queries, block_manager.stats.hits)
        self.metrics.set_worker_restarts(self.core.num_worker_restarts)

    def _stop_accepting(self, error: EngineDeadError, abort_in_core: bool) -> None:
        """Refuse new work and fail every pending request (and queued add) with `error`."""
        with self._lock:
            self._accepting = False
        for request_id, stream in self._streams.items():
            if abort_in_core:
                self.core.abort_request(request_id)
            self.metrics.on_request_finished("error")
            self._post(stream, type(error)(str(error)))
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._post(command.stream, type(error)(str(error)))
            elif isinstance(command, (_CoreCall, _Sleep)):
                command.loop.call_soon_threadsafe(_resolve, command.future, type(error)(str(error)))
        for add in self._deferred:
            self._post(add.stream, type(error)(str(error)))
        self._deferred.clear()
        for held in self._held:
            held.loop.call_soon_threadsafe(_resolve, held.future, type(error)(str(error)))
        self._held.clear()
        self._flush()

    def _post(self, stream: RequestStream, item: object) -> None:
        self._outbox.setdefault(stream._loop, []).append((stream, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass  # that event loop is closed: its consumers are gone
