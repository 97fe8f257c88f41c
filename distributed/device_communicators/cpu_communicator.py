"""CpuCommunicator: TP collectives between CPU ranks: shared memory on one host, gloo
otherwise.

gloo's all-reduce is correct everywhere, across hosts included, but slow between
processes of one host (about 300 µs for 96 KiB here, two per layer and step). When
every rank of the group runs on this host, the communicator maps one shared segment
(`ShmAllReduce`) and runs all-reduce and all-gather through it; dtypes it does not
cover (anything but float32/bfloat16/float16) go to gloo. `TP_CPU_SHM_ALLREDUCE=0` keeps gloo for everything.

Built on every rank together by `init_distributed_environment` (the setup itself runs
gloo collectives, so all ranks must be in it); the choice is the same on every rank.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from distributed.device_communicators.base import DeviceCommunicatorBase
from distributed.device_communicators.shm_allreduce import ShmAllReduce
from distributed.shm_utils import host_id

logger = logging.getLogger(__name__)


class CpuCommunicator(DeviceCommunicatorBase):
    dist_backend = "gloo"

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup,
                 timeout: timedelta | None = None) -> None:
        super().__init__(rank, world_size, group, timeout)
        self.shm: ShmAllReduce | None = None
        if os.environ.get("TP_CPU_SHM_ALLREDUCE", "1") == "0":
            return
        hosts = [""] * world_size
        dist.all_gather_object(hosts, host_id(), group=group)
        if len(set(hosts)) != 1:
            return  # ranks on several hosts: gloo
        try:
            self.shm = ShmAllReduce(rank, world_size, group,
                                    timeout_s=timeout.total_seconds() if timeout is not None else None)
        except OSError as e:
            if rank == 0:
                logger.warning("shared-memory all-reduce unavailable, using gloo: %s", e)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.supports(x):
            return self.shm.all_reduce(x)
        return super().all_reduce(x)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, norm_kernel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.shm is None:
            return None
        return self.shm.all_reduce_rms_norm(x, residual, weight, eps, norm_kernel)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.shm is not None and self.shm.supports(x):
            return self.shm.all_gather(x, dim)
        return super().all_gather(x, dim)

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
