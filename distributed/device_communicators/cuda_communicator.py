"""CudaCommunicator: TP collectives between GPUs, over NCCL.

Every rank's tensors live on its own device (`torch.cuda.current_device()`, set by
the worker before the group is created).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed.device_communicators.base import DeviceCommunicatorBase


class CudaCommunicator(DeviceCommunicatorBase):
    dist_backend = "nccl"

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """One `all_gather_into_tensor` into [world, *x.shape] (NCCL's native form, no
        per-rank tensors), then rank-major concatenation along `dim`."""
        dim = dim % x.dim()
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)
        # [world, ..., d, ...] -> [..., world, d, ...] -> [..., world * d, ...]
        out = out.movedim(0, dim)
        return out.reshape(*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1 :])
