"""Worker: one TP rank's device, process group, model, memory profile and KV cache.

Created inside each WorkerProc (or in-process by UniProcExecutor). The executor calls
its methods by name through `collective_rpc`, on every rank, in this order:
init_device(), load_model(), get_kv_cache_spec(), determine_available_memory() (unless
`num_gpu_blocks_override` fixes the block count), initialize_from_config(), then
execute_model() per step. Phase timings accumulate in
`self.timings` (seconds). Everything that differs between CUDA and the CPU is asked of
`self.platform`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from distributed import destroy_distributed_environment, init_distributed_environment
from worker.kv_cache import KVCacheConfig, KVCacheSpec
from worker.model_runner import ModelRunner
from worker.platform import Platform, get_platform

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from worker.outputs import ModelRunnerOutput, SchedulerOutput


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int, rank: int, distributed_init_method: str | None,
                 local_world_size: int | None = None) -> None:
        """`local_world_size`: the ranks on this host, which share its cores and memory
        (default: all of them; the external launcher passes torchrun's LOCAL_WORLD_SIZE)."""
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.world_size = config.parallel_config.world_size
        self.local_world_size = local_world_size if local_world_size is not None else self.world_size
        self.distributed_init_method = distributed_init_method
        self.platform: Platform = get_platform(config.device_config)
        self.device = self.platform.device_for(local_rank)
        self.model_runner: ModelRunner | None = None
        self.timings: dict[str, float] = {}
        self.model_memory_usage = 0
        self._memory_at_init = 0

    def init_device(self) -> None:
        """Bind the device (or the CPU threads) and join the TP process group."""
        start = time.perf_counter()
        self.platform.set_device(self.local_rank, self.local_world_size)
        torch.manual_seed(self.config.seed)
        _, self._memory_at_init = self.platform.total_and_free_memory()
        init_distributed_environment(self.world_size, self.rank, self.distributed_init_method, self.device)
        self.model_runner = ModelRunner(self.config, self.device)
        self.timings["distributed_init"] = time.perf_counter() - start

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"rank {self.rank}: init_device() must run first")
        return self.model_runner

    def load_model(self) -> None:
        """Load this rank's shard inside the "weights" memory pool."""
        runner = self._runner()
        with self.platform.memory_pool("weights") as usage:
            runner.load_model()
        assert runner.model is not None
        self.model_memory_usage = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        self.timings["load"] = usage.seconds

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes this rank can give the KV cache, after a profile forward pass at
        max_num_batched_tokens. `kv_cache_memory_bytes`, when set, is returned as is,
        with no profile run.

        How the budget follows from the profile is the platform's rule
        (`Platform.kv_cache_budget`).
        """
        start = time.perf_counter()
        cache_config = self.config.cache_config
        runner = self._runner()
        if cache_config.kv_cache_memory_bytes is not None:
            # The user fixed the budget: a profile run would be measured and thrown away.
            self.timings["profile"] = time.perf_counter() - start
            return cache_config.kv_cache_memory_bytes
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        peak_activation = self.platform.profile_peak_bytes(lambda: runner.profile_run(num_tokens))
        available = self.platform.kv_cache_budget(
            cache_config.gpu_memory_utilization, self._memory_at_init // self.local_world_size,
            self.model_memory_usage, peak_activation,
        )
        self.timings["profile"] = time.perf_counter() - start
        return max(0, available)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """What one KV block holds on this rank, from the model's attention layers."""
        return self._runner().get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the paged KV cache inside the "kv_cache" memory pool and attach it."""
        with self.platform.memory_pool("kv_cache") as usage:
            self._runner().initialize_kv_cache(kv_cache_config)
        self.timings["kv_alloc"] = usage.seconds

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner().execute_model(scheduler_output)

    def get_timings(self) -> dict[str, float]:
        return dict(self.timings)

    def check_health(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Leave the process group; safe to call more than once."""
        destroy_distributed_environment()
