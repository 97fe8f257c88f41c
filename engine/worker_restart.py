"""Self-healing: replace a failed worker group and re-run its requests.

`EngineConfig(max_worker_restarts=N)` (default 0: off). When the executor reports the
group dead (`EngineDeadError`: a rank died, stopped beating, hung in a step, or was left
out of step by a peer's failure), `EngineCore` asks `WorkerRestarter.restart`, which

1. shuts the old group down (every process, segment and socket of it),
2. starts a fresh executor from the same config and gives it the same KV cache
   layout (same block count: no profile run, the scheduler's block tables stay valid)
   and the same weights (the checkpoint of the last `update_weights(directory)`, if any),
3. preempts every running request by recompute (blocks freed, computed tokens 0: the
   request re-prefills its prompt plus the tokens it already generated, exactly like a
   preemption for lack of blocks) and forgets the prefix cache (its blocks' K/V lived in
   the dead group),

so the step that failed simply yields nothing, and the next steps carry on: greedy
outputs equal an undisturbed run, and a streaming client sees a pause, not an error.
Past N restarts within `worker_restart_window_s`, or when the restart itself fails, the
original failure is raised as without self-healing; so it is while the engine sleeps,
and after `update_weights` was given tensors by value (a fresh group could not have
them). Each restart is logged with its cause and counted (`EngineCore.num_worker_restarts`).

The restarter changes the core only through its public methods: `replace_executor`
(steps 1 and 2: the old group down, a fresh one up) and `rerun_running_requests` (3).

`restart` runs in the thread that steps the core (the only one that touches the
executor and the scheduler); other threads may only ask `can_restart`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Protocol

from executor.errors import EngineDeadError

if TYPE_CHECKING:
    from config import EngineConfig
    from executor.abstract import Executor
    from worker.kv_cache import KVCacheConfig

logger = logging.getLogger(__name__)


class RestartableEngine(Protocol):
    """What the restarter uses of EngineCore (named here, so that this module need not
    import the core that owns it)."""

    config: EngineConfig
    kv_cache_config: KVCacheConfig

    @property
    def is_sleeping(self) -> bool: ...
    @property
    def is_shut_down(self) -> bool: ...
    def replace_executor(self) -> Executor: ...
    def rerun_running_requests(self) -> int: ...


class WorkerRestarter:
    def __init__(self, core: RestartableEngine) -> None:
        # A weak reference: the core's finalizer must still run when the core is collected.
        self._core = weakref.ref(core)
        self.limit = core.config.max_worker_restarts
        self.window_s = core.config.worker_restart_window_s
        self._recent: deque[float] = deque()
        self.count = 0  # restarts so far, for metrics
        self.last_cause: str | None = None
        self.restarting = False  # read by other threads (health probes)
        # The weights a fresh group must load: the config's (None), a checkpoint directory
        # given to update_weights (loaded again after a restart), or tensors passed by
        # value, which are gone with the old group (no restart then).
        self._weights: str | None = None
        self._weights_lost = False

    def note_weights(self, directory: str | None) -> None:
        """EngineCore.update_weights succeeded: from `directory`, or (None) from tensors."""
        self._weights = directory
        self._weights_lost = directory is None

    def _why_not(self, core: RestartableEngine) -> str | None:
        if self._weights_lost:
            return "its weights were replaced by tensors passed to update_weights, which a fresh group cannot load"
        if core.is_sleeping:
            return "the engine is asleep (its pools were released on purpose); wake it up after a restart by hand"
        return None

    def can_restart(self) -> bool:
        """Whether a failure now would be healed (or one is being healed): any thread may
        ask, e.g. a health probe that must not report an engine about to heal as dead."""
        if self.restarting:
            return True
        core = self._core()
        if core is None or self.limit <= 0 or core.is_shut_down or self._why_not(core):
            return False
        now = time.monotonic()
        return sum(1 for t in self._recent if now - t <= self.window_s) < self.limit

    def restart(self, error: EngineDeadError) -> bool:
        """Replace the worker group after `error`. True: the engine may go on (the
        interrupted requests wait to be re-run); False: self-healing is off, the core
        was shut down, or N restarts within the window were used up: raise `error`.
        Raises EngineDeadError (from the cause) if the fresh group fails to start."""
        core = self._core()
        if core is None or self.limit <= 0 or core.is_shut_down:
            return False
        now = time.monotonic()
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        why_not = self._why_not(core)
        if why_not:
            logger.error("worker group failed (%s); not restarting it: %s", error, why_not)
            return False
        if len(self._recent) >= self.limit:
            logger.error("worker group failed again (%s) after %d restart(s) within %gs "
                         "(max_worker_restarts=%d): giving up", error, len(self._recent), self.window_s, self.limit)
            return False
        self._recent.append(now)
        self.restarting = True
        try:
            return self._restart(core, error)
        finally:
            self.restarting = False

    def _restart(self, core: RestartableEngine, error: EngineDeadError) -> bool:
        start = time.perf_counter()
        logger.warning("worker group failed: %s; restarting it (restart %d of at most %d within %gs)",
                       error, len(self._recent), self.limit, self.window_s)
        try:
            new = core.replace_executor()
        except BaseException as e:
            raise EngineDeadError(f"the worker group failed ({error}) and could not be restarted: "
                                  f"{type(e).__name__}: {e}") from e
        try:
            spec = new.get_kv_cache_spec()
            if spec.block_bytes != core.kv_cache_config.block_bytes:
                raise RuntimeError(f"the restarted group's KV block ({spec.block_bytes} bytes) differs from the "
                                   f"first one's ({core.kv_cache_config.block_bytes} bytes)")
            new.initialize_from_config(core.kv_cache_config)
            if self._weights is not None:
                new.collective_rpc("update_weights", args=(self._weights,))
        except BaseException as e:
            raise EngineDeadError(f"the worker group failed ({error}) and its replacement could not be set up "
                                  f"(KV cache, weights): {type(e).__name__}: {e}") from e
        # Preempt every running request by recompute, drop the step in flight and the prefix cache.
        rerun = core.rerun_running_requests()
        self.count += 1
        self.last_cause = str(error)
        logger.warning("worker group restarted in %.2fs; %d running request(s) will be re-run from their tokens",
                       time.perf_counter() - start, rerun)
        return True
