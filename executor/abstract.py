"""The Executor interface: how the engine reaches its workers.

`Executor.get_class(config)` maps `distributed_executor_backend` through
executor.registry: "uni" -> UniProcExecutor (in-process, tp=1), "mp" ->
MultiprocExecutor (default when tp > 1), any name given to `register_executor_backend`
(below), or a user's Executor subclass passed directly. All methods are called from the
engine's thread.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from executor.registry import add_executor_backend, get_executor_backend_cls
from executor.rpc import RPCMethod

if TYPE_CHECKING:
    from config import EngineConfig
    from worker.kv_cache import KVCacheConfig, KVCacheSpec
    from worker.outputs import ModelRunnerOutput, SchedulerOutput

__all__ = ["EXECUTE_MODEL_TIMEOUT_S", "Executor", "RPCMethod", "register_executor_backend"]

# A step that takes longer than this is treated as a hung rank (TimeoutError naming it),
# rather than blocking the engine forever.
EXECUTE_MODEL_TIMEOUT_S = float(os.environ.get("TP_EXECUTE_MODEL_TIMEOUT", "300"))


class Executor(ABC):
    # Whether execute_model(non_block=True) returns while the ranks still run the step,
    # so the engine can plan the next one meanwhile (async scheduling).
    supports_async_scheduling: ClassVar[bool] = False
    # Whether a step's grammar bitmask may follow the step (`send_grammar_bitmask`), so
    # the engine fills it while the ranks run the forward (structured outputs).
    supports_grammar_overlap: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size: int = config.parallel_config.world_size
        # Per-phase startup seconds: "spawn" here, worker phases gathered per rank.
        self.startup_timings: dict[str, float] = {}
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The class for `config.parallel_config.distributed_executor_backend`; imports
        only the chosen backend. Raises TypeError for a class that is not an Executor,
        ValueError (naming the registered backends) for an unknown name."""
        backend = config.parallel_config.distributed_executor_backend
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise TypeError(f"distributed_executor_backend={backend!r} must be a subclass of Executor")
            return backend
        if backend is None:
            backend = "uni" if config.parallel_config.world_size == 1 else "mp"
        return get_executor_backend_cls(backend)

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and leave them with a loaded model; raise on any failure."""

    @abstractmethod
    def collective_rpc(
        self,
        method: RPCMethod,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run `method` on every rank: a Worker method name, or a picklable
        `fn(worker, *args, **kwargs)`. Returns one result per rank, in rank order, or
        only `unique_reply_rank`'s result. Raises TimeoutError after `timeout` seconds,
        RemoteWorkerError for a worker exception, EngineDeadError once a worker died."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise EngineDeadError if any worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release every resource. Idempotent."""

    @property
    def output_rank(self) -> int:
        return 0

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_spec(self) -> "KVCacheSpec":
        """The KV block layout every rank's layers need; RuntimeError if ranks differ."""
        specs = self.collective_rpc("get_kv_cache_spec")
        if any(spec != specs[0] for spec in specs):
            raise RuntimeError(f"ranks disagree on the KV cache layout: {specs}")
        return specs[0]

    def initialize_from_config(self, kv_cache_config: "KVCacheConfig") -> None:
        self.collective_rpc("initialize_from_config", args=(kv_cache_config,))

    def compile_or_warm_up_model(self) -> None:
        """Capture the CUDA graphs on every rank (nothing where the config has none)."""
        self.collective_rpc("compile_or_warm_up_model")

    def execute_model(
        self, scheduler_output: "SchedulerOutput", non_block: bool = False
    ) -> "ModelRunnerOutput | Future[ModelRunnerOutput]":
        """Run one step on every rank; the output rank's result. With `non_block`, a
        Future of it: here one already done (the step ran on this thread), while an
        executor with `supports_async_scheduling` returns as soon as the step is sent."""
        if not non_block:
            return self.collective_rpc(
                "execute_model",
                args=(scheduler_output,),
                timeout=EXECUTE_MODEL_TIMEOUT_S,
                unique_reply_rank=self.output_rank,
            )
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as e:  # noqa: BLE001 - the caller gets it from the future
            future.set_exception(e)
        return future

    def send_grammar_bitmask(self, step: Future, bitmask: bytes | None, error: str | None = None) -> None:
        """Only where `supports_grammar_overlap`: the bitmask of `step` (a Future from
        `execute_model(non_block=True)` of an output with `grammar_follows`), or the
        engine's `error` making it, which fails the step on every rank."""
        raise NotImplementedError(f"{type(self).__name__} sends a step's grammar bitmask with the step")

    def worker_timings(self) -> list[dict[str, float]]:
        return self.collective_rpc("get_timings")


T = TypeVar("T", bound=type[Executor])


def register_executor_backend(name: str) -> Callable[[T], T]:
    """Class decorator: ``@register_executor_backend("mine")`` makes
    ``distributed_executor_backend="mine"`` use it (a user's name wins over a built-in).

    Only the engine's process resolves backends, so registering there, before the
    engine is built, is enough. Raises TypeError if the class is not an Executor.
    """

    def wrap(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"{cls!r} must subclass Executor to be registered as {name!r}")
        add_executor_backend(name, cls)
        return cls

    return wrap
