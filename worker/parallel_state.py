"""The tensor-parallel process-group handle: the one piece of global state we keep.

Who calls this: `Worker.init_device()` sets the group once per process; the parallel
layers in `models/layers/` read rank and size while they are built, and call the
collectives in their forward pass. With no group set, the process is rank 0 of 1 and
every collective is the identity, so `get_model()` works at TP=1 with no process group.

`models/layers` imports this module although `models` sits below `worker` in the
dependency order: the TP handle is deliberately shared, and this module imports
nothing from the project.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None when world_size == 1


_TP = TensorParallelGroup(rank=0, world_size=1, group=None)


def set_tensor_parallel_group(rank: int, world_size: int, group: dist.ProcessGroup | None) -> None:
    """Install this process's TP group. Called once per worker, after init_process_group."""
    global _TP
    if not 0 <= rank < world_size:
        raise ValueError(f"tp rank {rank} is outside [0, {world_size})")
    _TP = TensorParallelGroup(rank=rank, world_size=world_size, group=group)


def reset_tensor_parallel_group() -> None:
    """Back to the single-rank default (worker shutdown, tests)."""
    set_tensor_parallel_group(0, 1, None)


def get_tp_group() -> TensorParallelGroup:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place where the backend allows. Identity at size 1."""
    if _TP.world_size == 1:
        return x
    dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order. Identity at size 1."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)
