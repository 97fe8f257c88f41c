"""The platform a worker runs on: CUDA or the CPU, one class each.

`get_platform(device_config)` picks it from `DeviceConfig.device_type`. The Worker asks it
everything that differs between devices (which device a rank binds, its threads, how
much memory there is, how the profile run's peak is measured, how memory is pooled), so
the Worker itself never branches on the device type. The TP collectives choose their
communicator in `distributed/` from the same device type and `tp_communicator` (which
also decides here whether ranks may share a GPU); the attention backend and the linear
methods choose theirs in `models/layers/`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, ContextManager

import psutil
import torch

from models.layers.file_pages import trim_heap
from worker.cpu_affinity import allowed_cpus, cpu_binds
from worker.memory import PeakRSSSampler, PoolUsage, cpu_memory_pool, cuda_memory_pool, process_rss

if TYPE_CHECKING:
    from config import DeviceConfig



class Platform:
    device_type: str = ""

    def device_for(self, local_rank: int) -> torch.device:
        raise NotImplementedError

    def set_device(self, local_rank: int, world_size: int) -> None:
        """Bind this process to its device (CUDA) or its share of the cores (CPU);
        `world_size`: the ranks on this host. Called once, before the process group."""
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

    def __init__(self, shares_devices: bool = False) -> None:
        """`shares_devices`: the TP ranks may share a device (tp_communicator="gloo",
        whose collectives are staged through host memory): local rank r binds
        cuda:(r % visible devices). Otherwise (NCCL) each local rank needs its own."""
        self.shares_devices = shares_devices
        # How many of this host's ranks are bound to this rank's device (set_device).
        self.ranks_on_device = 1

    def device_for(self, local_rank: int) -> torch.device:
        index, _ = cuda_device_binding(local_rank, local_rank + 1, torch.cuda.device_count(), self.shares_devices)
        return torch.device("cuda", index)

    def set_device(self, local_rank: int, world_size: int) -> None:
        """Bind this process to its device (`cuda_device_binding`); `world_size` is the
        number of ranks on this host, which all see the same devices."""
        index, self.ranks_on_device = cuda_device_binding(local_rank, world_size, torch.cuda.device_count(),
                                                          self.shares_devices)
        torch.cuda.set_device(index)

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
        """(total × utilization − memory in use on the device now) / k − this rank's
        profile peak, k being the ranks bound to this device (`ranks_on_device`); at
        k = 1 that is total × utilization − in use − peak, the weights counted once, as
        in use already. Called after the profile run, which emptied this rank's cache.

        Why the k ranks' caches and peaks fit in total × utilization together: "in use"
        is the whole device's (every process's CUDA context, weights and allocator
        reserve, other processes' memory too). When a rank measures it, every peer has
        loaded its weights (this rank's profile forward completed collectives with all
        of them, so they are in their profile runs), none has allocated its KV cache
        (the engine allocates once every rank has answered), and a peer still holding
        profile memory only makes "in use" larger. So each rank's "in use" is at least
        U, what the device holds at steady state besides the caches and the activation
        peaks, and sum(budget + peak) over the k ranks <= total × utilization − U: the
        caches plus every rank's peak at once stay under total × utilization.
        (A per-process measurement, memory_reserved() plus the CUDA context from the
        free-memory drop across this rank's init, would miss other processes' memory,
        and the k ranks initialise at once, so one rank's drop holds part of a peer's.)"""
        total, free = self.total_and_free_memory()
        return shared_device_kv_budget(total, free, utilization, self.ranks_on_device, peak_bytes)

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
        trim_heap()


def get_platform(device_config: DeviceConfig, tp_communicator: str = "auto") -> Platform:
    """The platform of `device_config.device_type`; on CUDA, `tp_communicator` (the
    resolved ParallelConfig.tp_communicator) "gloo" lets ranks share a device."""
    if device_config.device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but torch.cuda.is_available() is False")
        return CudaPlatform(shares_devices=tp_communicator == "gloo")
    return CpuPlatform(device_config.cpu_threads_bind)


def cuda_device_binding(local_rank: int, local_world_size: int, device_count: int,
                        shares_devices: bool) -> tuple[int, int]:
    """(device index, how many of the host's `local_world_size` ranks bind that device)
    for `local_rank`: cuda:(local_rank % device_count) when ranks may share devices (so
    3 ranks on 2 GPUs put ranks 0 and 2 on cuda:0), else cuda:local_rank alone. Raises
    RuntimeError without a device, or when a rank needs one of its own and none is left
    (the resolution step refuses that config already; this names the rank at fault)."""
    if device_count == 0:
        raise RuntimeError(f"local_rank {local_rank}: no CUDA device is visible")
    if not shares_devices:
        if local_rank >= device_count:
            raise RuntimeError(
                f"local_rank {local_rank} needs a CUDA device of its own with tp_communicator='nccl' (NCCL puts "
                f"one rank on each device), but only {device_count} are visible; tp_communicator='gloo' lets "
                "the ranks share a GPU"
            )
        return local_rank, 1
    index = local_rank % device_count
    return index, len(range(index, max(local_world_size, local_rank + 1), device_count))


def shared_device_kv_budget(total: int, free: int, utilization: float, ranks_on_device: int, peak_bytes: int) -> int:
    """CudaPlatform.kv_cache_budget's rule on measured figures: (total × utilization −
    (total − free)) // ranks_on_device − peak_bytes (may be negative)."""
    return (int(total * utilization) - (total - free)) // ranks_on_device - peak_bytes


def threads_per_rank(world_size: int) -> int:
    """CPU threads for one unpinned rank, so that the ranks of one host do not
    oversubscribe it."""
    return max(1, len(allowed_cpus()) // world_size)


__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "cuda_device_binding", "get_platform",
           "shared_device_kv_budget", "threads_per_rank"]
