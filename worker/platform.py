"""The platform a worker runs on: CUDA or the CPU, one class each.

`get_platform(device_config)` picks it from `DeviceConfig.device_type`. The Worker asks it
everything that differs between devices (which device a rank binds, its threads, how
much memory there is, how the profile run's peak is measured, how memory is pooled), so
the Worker itself never branches on the device type. The TP collectives choose their
communicator in `distributed/` from the same device type; the attention backend and the
linear methods choose theirs in `models/layers/`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, ContextManager

import psutil
import torch

from worker.cpu_affinity import allowed_cpus, cpu_binds
from worker.memory import PeakRSSSampler, PoolUsage, cpu_memory_pool, cuda_memory_pool, process_rss
from worker.sleep_mode import trim_host_memory

if TYPE_CHECKING:
    from config import DeviceConfig



class Platform:
    device_type: str = ""

    def device_for(self, local_rank: int) -> torch.device:
        raise NotImplementedError

    def set_device(self, local_rank: int, world_size: int) -> None:
        """Bind this process to its device (CUDA) or its share of the cores (CPU)."""
        raise NotImplementedError

    def total_and_free_memory(self) -> tuple[int, int]:
        """(total, free) bytes of the memory this worker sizes its cache against."""
        raise NotImplementedError

    def profile_peak_bytes(self, run: Callable[[], None]) -> int:
        """Run `run` (the profile forward) and return how much memory it needed at its
        peak beyond what was in use before."""
        raise NotImplementedError

    def kv_cache_budget(self, utilization: float, share_at_init: int, weights_bytes: int, peak_bytes: int) -> int:
        """Bytes left for the KV cache after the profile run (may be negative).
        `share_at_init`: this rank's share of the free memory when it started."""
        raise NotImplementedError

    def memory_pool(self, tag: str) -> ContextManager[PoolUsage]:
        """Account (and on CUDA, pool) every allocation made inside the block under `tag`."""
        raise NotImplementedError

    def memory_in_use(self) -> int:
        """Bytes this process holds now (what sleep mode reports freeing)."""
        raise NotImplementedError

    def release_cached_memory(self) -> None:
        """Hand memory that the allocator keeps for reuse back to the device or the OS."""
        raise NotImplementedError

    @property
    def offloads_weights_to_host(self) -> bool:
        """Whether sleep level 1 must copy the weights to host memory to free them."""
        return False


class CudaPlatform(Platform):
    device_type = "cuda"

    def device_for(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def set_device(self, local_rank: int, world_size: int) -> None:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local_rank {local_rank} needs a CUDA device, but only {torch.cuda.device_count()} are visible"
            )
        torch.cuda.set_device(local_rank)

    def total_and_free_memory(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info()
        return total, free

    def profile_peak_bytes(self, run: Callable[[], None]) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline_allocated = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline_allocated
        # Hand the profile's cached blocks back: mem_get_info counts reserved memory as
        # used, and the peak is already accounted for here.
        torch.cuda.empty_cache()
        return peak

    def kv_cache_budget(self, utilization: float, share_at_init: int, weights_bytes: int, peak_bytes: int) -> int:
        """total × utilization − memory in use now − the profile's peak (the weights are
        in use already, so they count once)."""
        total, free = self.total_and_free_memory()
        return int(total * utilization) - (total - free) - peak_bytes

    def memory_pool(self, tag: str) -> ContextManager[PoolUsage]:
        return cuda_memory_pool(tag)

    def memory_in_use(self) -> int:
        return torch.cuda.memory_reserved()

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()

    @property
    def offloads_weights_to_host(self) -> bool:
        return True


class CpuPlatform(Platform):
    device_type = "cpu"

    def __init__(self, cpu_threads_bind: str = "auto") -> None:
        self.cpu_threads_bind = cpu_threads_bind

    def device_for(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def set_device(self, local_rank: int, world_size: int) -> None:
        """Pin this rank to its cores (`cpu_threads_bind`) with one torch thread per
        core; unpinned, the ranks of one host share its cores with an equal number of
        threads each. Raises CpuBindError for a bind that cannot be applied."""
        binds = cpu_binds(self.cpu_threads_bind, world_size, allowed_cpus())
        if binds is None:
            torch.set_num_threads(threads_per_rank(world_size))
            return
        cores = binds[local_rank]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))

    def total_and_free_memory(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.total, vm.available

    def profile_peak_bytes(self, run: Callable[[], None]) -> int:
        # torch keeps no peak statistics on the CPU: sample the RSS while it runs.
        rss_before = process_rss()
        with PeakRSSSampler() as sampler:
            run()
        return max(0, sampler.peak - rss_before)

    def kv_cache_budget(self, utilization: float, share_at_init: int, weights_bytes: int, peak_bytes: int) -> int:
        """utilization × this rank's share of host memory at init − its weights − the
        profile's peak RSS growth (the ranks of one host share its memory)."""
        return int(utilization * share_at_init) - weights_bytes - peak_bytes

    def memory_pool(self, tag: str) -> ContextManager[PoolUsage]:
        return cpu_memory_pool(tag)

    def memory_in_use(self) -> int:
        return process_rss()

    def release_cached_memory(self) -> None:
        trim_host_memory()


def get_platform(device_config: DeviceConfig) -> Platform:
    if device_config.device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but torch.cuda.is_available() is False")
        return CudaPlatform()
    return CpuPlatform(device_config.cpu_threads_bind)


def threads_per_rank(world_size: int) -> int:
    """CPU threads for one unpinned rank, so that the ranks of one host do not
    oversubscribe it."""
    return max(1, len(allowed_cpus()) // world_size)


__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "get_platform", "threads_per_rank"]
