"""EngineCore's sleep mode and weight updates: how an RL loop shares the devices with
training (vLLM's `sleep`, `wake_up`, and a weight sync between rollouts).

`SleepModeMixin` is mixed into EngineCore; its state lives on the core (`_sleep_level`:
None while awake, else the level; `_undelivered`: outputs that finished on the way
to sleep, which the next `step()` returns). Every method runs on the thread that
steps the core.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from config import EngineConfig
    from engine.output_processor import OutputProcessor, ParentRequest
    from engine.scheduler import Scheduler
    from engine.worker_restart import WorkerRestarter

logger = logging.getLogger(__name__)

GiB = 1 << 30


class SleepModeMixin:
    """EngineCore's `is_sleeping`, `sleep`, `wake_up` and `update_weights`."""

    # Set by EngineCore.__init__.
    config: EngineConfig
    scheduler: Scheduler
    output_processor: OutputProcessor
    _worker_restarter: WorkerRestarter
    _sleep_level: int | None
    _undelivered: list[RequestOutput]

    if TYPE_CHECKING:  # defined by EngineCore: the step loop and RPC
        def _step(self) -> list[RequestOutput]: ...
        def _outputs(self, parents: Iterable[ParentRequest]) -> list[RequestOutput]: ...
        def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> Any: ...
        def reset_prefix_cache(self) -> int: ...

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def sleep(self, level: int = 1, abort: bool = False) -> list[dict[str, Any]]:
        """Pause (level 0) or hand memory back: level 1 frees the KV cache and moves the
        weights to host memory (where they are not there already: on the CPU they
        stay), level 2 frees both and `wake_up` reloads the weights. Sleeping again
        at a deeper level deepens it; at the same or a lower level it changes nothing.

        Unfinished requests are run to completion first (at level 0 they just pause),
        or, with `abort=True`, finish at once as aborted; either way their final
        outputs come from the next `step()`. Requests added while asleep wait. Returns
        each rank's report (bytes freed per pool, memory before and after, seconds);
        level 0 returns none. Raises RuntimeError unless `enable_sleep_mode`."""
        if not self.config.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: build the engine with EngineConfig(enable_sleep_mode=True) "
                               "(engine.serve --enable-sleep-mode)")
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level={level!r} must be 0, 1 or 2")
        start = time.perf_counter()
        if abort:
            self._undelivered += self._abort_all()
        current = self._sleep_level
        if level == 0:
            self._sleep_level = current or 0
            logger.info("sleep(level=0): scheduling paused")
            return []
        self._sleep_level = None  # a paused engine may still drain
        try:
            while self.scheduler.has_unfinished_requests():
                self._undelivered += self._step()
        finally:
            self._sleep_level = max(level, current or 0)
        level = self._sleep_level
        reports = self.collective_rpc("sleep", args=(level,))
        self.reset_prefix_cache()  # the cached blocks' K/V is gone
        self._log_memory(f"sleep(level={level})", reports, time.perf_counter() - start)
        return reports

    def wake_up(self, tags: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Restore the memory pools in `tags` ("weights", "kv_cache"; default both),
        weights first; the engine runs again once both are back (two calls let an RL
        loop load new weights before the cache returns). Waking what is awake changes
        nothing. Returns each rank's report (bytes restored per pool, seconds)."""
        if tags is not None:
            unknown = [t for t in tags if t not in ("weights", "kv_cache")]
            if unknown:
                raise ValueError(f"wake_up tags {unknown} are not memory pools; valid tags: ['weights', 'kv_cache']")
        if self._sleep_level is None:
            return []
        if self._sleep_level == 0:
            self._sleep_level = None
            logger.info("wake_up: scheduling resumed")
            return []
        start = time.perf_counter()
        reports = self.collective_rpc("wake_up", args=(list(tags) if tags is not None else None,))
        if all(state == "awake" for report in reports for state in report["state"].values()):
            self._sleep_level = None
        self._log_memory(f"wake_up(tags={list(tags) if tags else 'all'})", reports, time.perf_counter() - start)
        return reports

    def update_weights(
        self, source: str | os.PathLike | Mapping[str, Any] | Iterable[tuple[str, Any]]
    ) -> list[dict[str, Any]]:
        """Load new weights into the running model on every rank, as RL loops do after
        each training step: every weight from a checkpoint directory (same
        architecture and load format), or named, unsharded checkpoint tensors (any
        subset: each rank takes its slice). Drops the prefix cache. Requests already
        running continue with the K/V they computed. The weights must be awake.
        Returns each rank's report (seconds)."""
        start = time.perf_counter()
        if isinstance(source, (str, os.PathLike)):
            payload: Any = os.fspath(source)
            if not os.path.isdir(payload):
                raise ValueError(f"update_weights: {payload!r} is not a checkpoint directory")
        else:
            payload = list(source.items()) if isinstance(source, Mapping) else list(source)
        reports = self.collective_rpc("update_weights", args=(payload,))
        self._worker_restarter.note_weights(payload if isinstance(payload, str) else None)
        self.reset_prefix_cache()
        logger.info("update_weights from %s in %.2fs (slowest rank %.2fs)",
                    payload if isinstance(payload, str) else f"{len(payload)} tensors", time.perf_counter() - start,
                    max(r["seconds"] for r in reports))
        return reports

    def _log_memory(self, what: str, reports: list[dict[str, Any]], seconds: float) -> None:
        for r in reports:
            pools = ", ".join(f"{tag} {n / GiB:.2f} GiB" for tag, n in r["bytes"].items()) or "nothing"
            logger.info("%s rank %d: %s (memory in use %.2f -> %.2f GiB) in %.2fs", what, r["rank"], pools,
                        r["memory_before"] / GiB, r["memory_after"] / GiB, r["seconds"])
        logger.info("%s done in %.2fs", what, seconds)

    def _abort_all(self) -> list[RequestOutput]:
        """End every unfinished request as aborted; returns their final outputs."""
        parents = {}
        for request in list(self.scheduler.requests.values()):
            self.scheduler.abort_request(request.request_id)
            parent, _ = self.output_processor.process(request)
            parents[parent.request_id] = parent
        outputs = self._outputs(parents.values())
        for parent in parents.values():  # a best_of parent has no output to give until all ended
            self.output_processor.remove(parent.request_id)
        return outputs
