"""Worker: one TP rank's device, process group, model, memory profile and KV cache.

Created inside each WorkerProc (or in-process by UniProcExecutor). The executor calls
its methods by name through `collective_rpc`, in this order: init_device(),
load_model(), determine_available_memory(), initialize_from_config(), then
execute_model() per step. Phase timings accumulate in `self.timings` (seconds).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from worker.kv_cache import KVCacheConfig
from worker.memory import PeakRSSSampler, PoolUsage, memory_pool, process_rss
from worker.model_runner import ModelRunner
from worker.parallel_state import reset_tensor_parallel_group, set_tensor_parallel_group
from worker.platform import Platform, get_platform, threads_per_rank

if TYPE_CHECKING:
    from engine.outputs import ModelRunnerOutput, SchedulerOutput


class Worker:
    def __init__(self, config: Any, local_rank: int, rank: int, distributed_init_method: str | None) -> None:
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.world_size = config.parallel_config.world_size
        self.distributed_init_method = distributed_init_method
        self.platform: Platform = get_platform(config.device_config.device_type)
        self.device = self.platform.device_for(local_rank)
        self.model_runner: ModelRunner | None = None
        self.pools: dict[str, PoolUsage] = {}
        self.timings: dict[str, float] = {}
        self.model_memory_usage = 0
        self._memory_at_init = 0

    def init_device(self) -> None:
        """Bind the device, set CPU threads, and join the TP process group (nccl | gloo)."""
        start = time.perf_counter()
        self.platform.set_device(self.local_rank)
        if self.platform.device_type == "cpu":
            torch.set_num_threads(threads_per_rank(self.world_size))
        torch.manual_seed(self.config.seed)
        _, self._memory_at_init = self.platform.total_and_free_memory()
        if self.world_size > 1:
            if self.distributed_init_method is None:
                raise RuntimeError(f"rank {self.rank}: tensor_parallel_size > 1 needs a distributed_init_method")
            dist.init_process_group(
                backend=self.platform.dist_backend,
                init_method=self.distributed_init_method,
                rank=self.rank,
                world_size=self.world_size,
                device_id=self.device if self.platform.device_type == "cuda" else None,
            )
            set_tensor_parallel_group(self.rank, self.world_size, dist.group.WORLD)
            # One tiny collective now, so a broken rendezvous fails here and not mid-load.
            dist.barrier()
        self.model_runner = ModelRunner(self.config, self.device)
        self.timings["distributed_init"] = time.perf_counter() - start

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"rank {self.rank}: init_device() must run first")
        return self.model_runner

    def load_model(self) -> None:
        """Load this rank's shard inside memory_pool("weights")."""
        runner = self._runner()
        with memory_pool("weights", self.platform.device_type) as usage:
            runner.load_model()
        self.pools["weights"] = usage
        assert runner.model is not None
        self.model_memory_usage = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        self.timings["load"] = usage.seconds

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes this rank can give the KV cache, after a profile forward pass at
        max_num_batched_tokens. `kv_cache_memory_bytes`, when set, is returned as is,
        with no profile run.

        CUDA: total × gpu_memory_utilization − (memory in use after the profile run,
        with the torch peak instead of the current allocation).
        CPU: gpu_memory_utilization × host memory available at init ÷ ranks on this
        host − weights − the profile's peak RSS growth.
        """
        start = time.perf_counter()
        cache_config = self.config.cache_config
        runner = self._runner()
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        if cache_config.kv_cache_memory_bytes is not None:
            # The user fixed the budget: a profile run would be measured and thrown away.
            self.timings["profile"] = time.perf_counter() - start
            return cache_config.kv_cache_memory_bytes
        if self.platform.device_type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            baseline_allocated = torch.cuda.memory_allocated()
            runner.profile_run(num_tokens)
            torch.cuda.synchronize()
            peak_activation = torch.cuda.max_memory_allocated() - baseline_allocated
            # Hand the profile's cached blocks back first: mem_get_info counts reserved
            # memory as used, and the peak is already accounted for above.
            torch.cuda.empty_cache()
            total, free = self.platform.total_and_free_memory()
            used_now = total - free
            available = int(total * cache_config.gpu_memory_utilization) - used_now - peak_activation
        else:
            rss_before = process_rss()
            with PeakRSSSampler() as sampler:
                runner.profile_run(num_tokens)
            peak_growth = max(0, sampler.peak - rss_before)
            budget = cache_config.gpu_memory_utilization * self._memory_at_init / self.world_size
            available = int(budget) - self.model_memory_usage - peak_growth
        self.timings["profile"] = time.perf_counter() - start
        return max(0, available)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the paged KV cache inside memory_pool("kv_cache") and attach it."""
        with memory_pool("kv_cache", self.platform.device_type) as usage:
            self._runner().initialize_kv_cache(kv_cache_config)
        self.pools["kv_cache"] = usage
        self.timings["kv_alloc"] = usage.seconds

    def execute_model(self, scheduler_output: "SchedulerOutput") -> "ModelRunnerOutput":
        return self._runner().execute_model(scheduler_output)

    def get_timings(self) -> dict[str, float]:
        return dict(self.timings)

    def check_health(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Leave the process group; safe to call more than once."""
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_tensor_parallel_group()
