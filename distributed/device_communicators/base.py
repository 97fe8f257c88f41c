"""DeviceCommunicatorBase: the collectives one TP group runs, over torch.distributed.

One instance per process, created by `init_distributed_environment` once the process
group exists, held by the TP group handle. Every rank of the group must call each
collective in the same order with tensors of the same shape and dtype (the usual
torch.distributed contract); a rank that does not arrive leaves the others blocked in
the backend until the engine notices and tears the group down, or until the group's
`timeout` (init_distributed_environment's) runs out: then the collective raises (gloo,
the shared-memory path) or NCCL's watchdog ends the process.
"""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist


class DeviceCommunicatorBase:
    """The reference implementation: the torch.distributed collective of the group's
    backend. Subclasses name their backend and may override a collective with a faster
    one, as long as the result is the same on every rank."""

    dist_backend: ClassVar[str] = ""
    # True where a collective only queues work on the device's stream and returns (NCCL):
    # a rank then waits for its peers later, wherever the host next syncs with the device
    # (`distributed.parallel_state.device_sync_point` marks that wait for the liveness
    # board). False where the call returns with the result in place (gloo, shared memory).
    completes_at_device_sync: ClassVar[bool] = False

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup,
                 timeout: timedelta | None = None) -> None:
        """`timeout`: how long one collective may wait for its peers (None: no limit of
        ours; the process group has its own, set when it was created)."""
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.timeout = timeout

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x`."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order (a new tensor)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, norm_kernel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`all_reduce(x)`, the residual add and the RMSNorm in one fused call, where a
        communicator has one (the CPU's shared-memory kernel): (normed, x), x holding the
        sum plus `residual`. None here, with nothing sent: the caller all-reduces and norms
        on its own. `norm_kernel` is the address of a C function with cpu_ops.c's
        `cpu_rms_norm` signature. Like every collective, called by every rank alike."""
        return None

    def destroy(self) -> None:
        """Release whatever the communicator holds beyond the process group (nothing here)."""
