"""UniProcExecutor: one Worker in the engine's own process (tp=1, debugging)."""

from __future__ import annotations

import time
from typing import Any

from executor.abstract import Executor
from executor.errors import EngineDeadError
from executor.rpc import RPCMethod, check_rpc_method, run_method
from worker.worker import Worker


class UniProcExecutor(Executor):
    """`timeout` is not enforced in-process: the call runs on the caller's thread."""

    def _init_executor(self) -> None:
        start = time.perf_counter()
        self.worker: Worker | None = Worker(self.config, local_rank=0, rank=0, distributed_init_method=None)
        self.worker.init_device()
        self.worker.load_model()
        self.startup_timings["spawn"] = 0.0
        self.startup_timings["startup_total"] = time.perf_counter() - start

    def collective_rpc(
        self,
        method: RPCMethod,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        check_rpc_method(method)
        if self.worker is None:
            raise EngineDeadError("the executor has been shut down")
        result = run_method(self.worker, method, args, kwargs or {})
        return result if unique_reply_rank is not None else [result]

    def check_health(self) -> None:
        if self.worker is None:
            raise EngineDeadError("the executor has been shut down")

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
