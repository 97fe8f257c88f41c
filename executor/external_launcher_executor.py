"""ExternalLauncherExecutor: this rank's worker, in this rank's own process, under torchrun.

vLLM's `distributed_executor_backend="external_launcher"`. torchrun (or any launcher
that sets its variables) starts one process per rank, and every process builds its own
`EngineCore`; the executor joins the process group torchrun set up (env:// rendezvous:
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) instead of spawning workers.
Multi-node is torchrun's own `--nnodes/--node-rank/--rdzv-endpoint`.

What every rank must do identically: build the same EngineConfig (WORLD_SIZE ==
tensor_parallel_size), and then either call `generate()` / `add_request()` with the
same requests in the same order (the ranks then schedule alike, and rank 0's sampled
tokens are broadcast each step so they stay alike), or let rank 0 `lead()` while every
other rank `follow()`s it (engine.serve: only rank 0 has requests). The channel that
keeps the ranks in step is executor/lockstep.py.

`collective_rpc` runs on this rank's worker only and returns this rank's result (a
list of one, or the result itself with `unique_reply_rank`), as vLLM's does: each
rank's engine reaches only its own worker. While rank 0 leads, each of its calls is
sent to the followers first, so their workers run it too.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from executor.abstract import Executor
from executor.errors import EngineDeadError
from executor.lockstep import LockstepChannel, LockstepFollower
from executor.parent_death import set_parent_death_signal
from executor.rpc import RPCMethod, check_rpc_method, run_method
from worker.worker import Worker

if TYPE_CHECKING:
    from worker.kv_cache import KVCacheSpec
    from worker.outputs import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LauncherEnvError(ValueError):
    """The process was not started the way the external launcher needs (a torchrun
    variable missing or invalid, or WORLD_SIZE not tensor_parallel_size); the message
    names the variable and the field."""


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # ranks on this node (LOCAL_WORLD_SIZE; WORLD_SIZE when unset)


def read_torchrun_env(tensor_parallel_size: int, environ: Mapping[str, str] = os.environ) -> TorchrunEnv:
    """This process's rank from torchrun's variables. Raises LauncherEnvError naming
    every missing variable, a non-integer one, or WORLD_SIZE != tensor_parallel_size."""
    missing = [name for name in TORCHRUN_ENV if not environ.get(name)]
    if missing:
        raise LauncherEnvError(
            f"distributed_executor_backend='external_launcher' needs torchrun's environment, but "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start every rank with "
            f"`torchrun --nproc-per-node {tensor_parallel_size} ...` (or set {', '.join(TORCHRUN_ENV)})"
        )
    values: dict[str, int] = {}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        text = environ.get(name)
        if text is None:  # only LOCAL_WORLD_SIZE may be unset
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise LauncherEnvError(f"{name}={text!r} is not an integer (set by torchrun)") from None
    world_size = values["WORLD_SIZE"]
    if world_size != tensor_parallel_size:
        raise LauncherEnvError(
            f"WORLD_SIZE={world_size} (torchrun's process count) != tensor_parallel_size={tensor_parallel_size}: "
            "the external launcher runs one TP rank per process, so they must be equal"
        )
    local_world_size = values.get("LOCAL_WORLD_SIZE", world_size)
    rank, local_rank = values["RANK"], values["LOCAL_RANK"]
    if not 0 <= rank < world_size:
        raise LauncherEnvError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    if not 0 <= local_rank < local_world_size:
        raise LauncherEnvError(f"LOCAL_RANK={local_rank} is outside [0, LOCAL_WORLD_SIZE={local_world_size})")
    return TorchrunEnv(rank, local_rank, world_size, local_world_size)


def _terminate_with_torchrun() -> None:
    """Under torchrun's agent (our parent, which starts every rank in a session of its
    own), ask Linux to SIGTERM this rank when the agent dies, even by SIGKILL: the rank
    then shuts down as it does at torchrun's own SIGTERM, instead of serving on alone."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        set_parent_death_signal(signal.SIGTERM)


class ExternalLauncherExecutor(Executor):
    """Every method is called from this rank's engine thread; the ones marked
    "every rank" are collectives that each rank's EngineCore calls at the same point."""

    def _init_executor(self) -> None:
        start = time.perf_counter()
        env = read_torchrun_env(self.world_size)
        _terminate_with_torchrun()
        self.rank = env.rank
        self.channel: LockstepChannel | None = None
        self._leading = False
        self._failure: str | None = None
        self.worker: Worker | None = Worker(self.config, local_rank=env.local_rank, rank=env.rank,
                                            distributed_init_method="env://", local_world_size=env.local_world_size)
        try:
            self.worker.init_device()
            if self.world_size > 1:
                self.channel = LockstepChannel(env.rank, self.world_size)
            self.worker.load_model()
        except BaseException:
            self.shutdown()
            raise
        self.startup_timings["spawn"] = 0.0  # torchrun started us
        self.startup_timings["startup_total"] = time.perf_counter() - start

    def _live_worker(self) -> Worker:
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        if self.worker is None:
            raise EngineDeadError("the executor has been shut down")
        return self.worker

    # ------------------------------------------------------------- start-up, every rank

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """Every rank. RuntimeError if the ranks' layers disagree."""
        spec = self._live_worker().get_kv_cache_spec()
        specs = self.channel.gather(spec) if self.channel is not None else [spec]
        if any(s != spec for s in specs):
            raise RuntimeError(f"ranks disagree on the KV cache layout: {specs}")
        return spec

    def determine_available_memory(self) -> list[int]:
        """Every rank: the smallest rank's KV budget (an all-reduce MIN), so that every
        rank's EngineCore sizes the same cache. A list of one."""
        available = self._live_worker().determine_available_memory()
        return [self.channel.min_over_ranks(available) if self.channel is not None else available]

    def worker_timings(self) -> list[dict[str, float]]:
        """Every rank: each rank's start-up phase timings, in rank order."""
        timings = self._live_worker().get_timings()
        return self.channel.gather(timings) if self.channel is not None else [timings]

    # ------------------------------------------------------------- calls

    def collective_rpc(
        self,
        method: RPCMethod,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run `method` on this rank's worker (sent to the followers first while rank 0
        leads); `timeout` is not enforced, the call runs on the caller's thread."""
        check_rpc_method(method)
        worker = self._live_worker()
        kwargs = dict(kwargs or {})
        if self._leading:
            assert self.channel is not None
            try:
                self.channel.send_call(method, tuple(args), kwargs)
            except Exception as e:  # noqa: BLE001 - gloo's error for a follower that is gone
                self._failure = f"rank 0 cannot reach the follower ranks: {e}"
                raise EngineDeadError(self._failure) from e
        result = run_method(worker, method, args, kwargs)
        return result if unique_reply_rank is not None else [result]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.collective_rpc("execute_model", args=(scheduler_output,), unique_reply_rank=self.output_rank)
        if self.channel is not None and not self._leading:
            # Every rank stepped on its own: make it rank 0's tokens, so no scheduler drifts.
            scheduler_config = self.config.scheduler_config
            output = self.channel.sync_sampled_tokens(
                scheduler_output, output, scheduler_config.max_num_seqs, scheduler_config.num_scheduler_steps)
        return output

    # ------------------------------------------------------------- lead and follow

    def lead(self) -> None:
        """Rank 0, once its EngineCore is ready: from now on every call this executor
        makes (each step's execute_model included) runs on the followers too. Every
        other rank must be in `follow()`."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} cannot lead: only rank 0 does")
        self._leading = self.channel is not None

    def follow(self, should_leave: Callable[[], bool] = lambda: False) -> bool:
        """Ranks > 0, once their EngineCore is ready: run rank 0's calls until rank 0
        shuts down (returns True) or `should_leave()` turns True while rank 0 is silent
        (returns False). Raises LeaderLostError when rank 0 is gone."""
        if self.channel is None or self.rank == 0:
            raise RuntimeError(f"rank {self.rank} cannot follow: only ranks > 0 of a TP group do")
        return LockstepFollower(self.channel, self._live_worker()).run(should_leave)

    # ------------------------------------------------------------- health and shutdown

    def check_health(self) -> None:
        self._live_worker()

    def shutdown(self) -> None:
        """Tell the followers to stop (when leading), then leave the process group.
        Idempotent. A follower's shutdown does not wait for rank 0."""
        if self.worker is None:
            return
        if self._leading and self._failure is None:
            assert self.channel is not None
            try:
                self.channel.send_shutdown()
            except Exception as e:  # noqa: BLE001 - a follower already gone; leave anyway
                logger.warning("rank 0 could not tell every follower to stop: %s", e)
        self._leading = False
        self.worker.shutdown()
        self.worker = None
