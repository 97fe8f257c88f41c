"""The platform a worker runs on: CUDA (NCCL) or CPU (gloo).

Selected at run time from `DeviceConfig.device_type`; nothing else in the worker
branches on the device type.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True)
class Platform:
    device_type: str  # "cuda" | "cpu"
    dist_backend: str  # "nccl" | "gloo"

    def device_for(self, local_rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", local_rank)
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        if self.device_type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise RuntimeError(
                    f"local_rank {local_rank} needs a CUDA device, but only {torch.cuda.device_count()} are visible"
                )
            torch.cuda.set_device(local_rank)

    def total_and_free_memory(self) -> tuple[int, int]:
        """(total, free) bytes of the device memory this worker sizes its cache against."""
        if self.device_type == "cuda":
            free, total = torch.cuda.mem_get_info()
            return total, free
        vm = psutil.virtual_memory()
        return vm.total, vm.available

    def synchronize(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()


def get_platform(device_type: str) -> Platform:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but torch.cuda.is_available() is False")
        return Platform("cuda", "nccl")
    return Platform("cpu", "gloo")


def threads_per_rank(world_size: int) -> int:
    """CPU threads for one rank, so that the ranks of one host do not oversubscribe it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)
