"""AsyncEngine: an EngineCore driven by one background thread, consumed from asyncio
(vLLM's AsyncLLM front over its engine core).

Requests are validated on the caller's thread (engine/processor.py: a bad one raises
ValueError before it is queued), then handed, processed, to the engine loop
(engine/engine_loop.py), the one thread that steps the core; each request's outputs
come back through its `RequestStream` (engine/request_stream.py).

Every accepted request ends in exactly one of: a finished output, an error raised from
its stream (`EngineDeadError` when a worker died, `EngineShutdownError` at shutdown), or
an abort that its own consumer asked for. A request submitted after the loop stopped is
refused at once. Outputs are cumulative, so a slow consumer simply skips to the newest.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from config import RequestOutputKind, SamplingParams
from engine.core import EngineCore
from engine.engine_loop import AddCommand, EngineLoop, SleepCommand, UtilityCommand
from engine.metrics import EngineMetrics
from engine.outputs import RequestOutput
from engine.processor import EngineCoreRequest, Prompt
from engine.request_stream import EngineShutdownError, RequestAbortedError, RequestStream
from executor.errors import EngineDeadError

HEALTH_CHECK_INTERVAL_S = 1.0

# What callers import from here along with AsyncEngine (the stream and its errors live in
# engine/request_stream.py).
__all__ = ["AsyncEngine", "EngineShutdownError", "HEALTH_CHECK_INTERVAL_S", "RequestAbortedError", "RequestStream"]


class AsyncEngine:
    """Owns an EngineCore and the engine loop that steps it. Its methods may be called
    from any thread; the coroutines from any event loop (each stream belongs to the
    loop that added its request)."""

    def __init__(
        self,
        core: EngineCore,
        *,
        metrics: EngineMetrics | None = None,
        health_check_interval_s: float = HEALTH_CHECK_INTERVAL_S,
        log_stats: bool = True,
    ) -> None:
        self.core = core
        self.processor = core.processor  # reads immutable state only: safe on any thread
        self.metrics = metrics or EngineMetrics(core.config.model, core.config.scheduler_config.max_model_len)
        self.metrics.set_cache_config_info(core.cache_config_info())
        self.engine_loop = EngineLoop(core, self.metrics, health_check_interval_s, log_stats)
        self.dead_event = self.engine_loop.dead_event  # set once the engine died (not at a clean shutdown)

    # ------------------------------------------------------------------ facts

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.config.scheduler_config.max_model_len

    @property
    def errored(self) -> bool:
        return self.engine_loop.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.engine_loop.dead_error

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine loop failed or any worker is gone."""
        if self.engine_loop.dead_error is not None:
            raise EngineDeadError(str(self.engine_loop.dead_error))
        if self.engine_loop.stopping:
            raise EngineShutdownError("the engine has been shut down")
        self.core.check_health(restart=False)  # any thread: only the engine loop replaces workers

    # -------------------------------------------------------------- requests

    async def add_request(
        self,
        prompt: Prompt | EngineCoreRequest,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the core accepted it (see EngineCore.add_request).
        A plain prompt is validated here, on the caller's thread; an `EngineCoreRequest`
        (the server's, from `self.processor`) was validated already (the other
        arguments are then unused).

        Raises ValueError when the processor or the core refuses it (the server turns
        that into a 400), EngineDeadError when the engine is dead or shutting down.
        """
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
        else:
            request_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
            request = self.processor.process_inputs(request_id, prompt, sampling_params, cache_salt)
        stream = RequestStream(request.request_id, request.prompt_token_ids, asyncio.get_running_loop(),
                               deltas=request.sampling_params.output_kind is RequestOutputKind.DELTA)
        self.engine_loop.submit(AddCommand(stream, request))
        try:
            await stream.accepted
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

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are a no-op."""
        self.engine_loop.abort(request_id)

    # ------------------------------------------------------ sleep mode, calls

    @property
    def is_sleeping(self) -> bool:
        """True from a `sleep` call until `wake_up` brought everything back."""
        return self.engine_loop.sleeping

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
        self.engine_loop.submit(SleepCommand(level, abort, loop, future))
        return await future

    async def wake_up(self, tags: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """EngineCore.wake_up on the engine loop; once awake, the requests that waited
        are accepted in their order of arrival."""
        return await self._on_loop(lambda core: self.engine_loop.wake_up(tags))

    async def reset_prefix_cache(self) -> int:
        """Drop every cached KV block (EngineCore.reset_prefix_cache, run on the engine
        loop between steps); returns how many were cached. Raises EngineDeadError."""
        return await self._on_loop(lambda core: core.reset_prefix_cache())

    async def _on_loop(self, fn: Callable[[EngineCore], Any]) -> Any:
        """`fn(core)`'s result (or exception), run by the engine loop between steps."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.engine_loop.submit(UtilityCommand(fn, loop, future))
        return await future

    # ------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = 30.0) -> None:
        """Fail whatever is still pending with EngineShutdownError, stop the loop and
        shut the core down. Idempotent; callable from any thread but the loop's."""
        if self.engine_loop.stop(timeout):
            self.core.shutdown()
