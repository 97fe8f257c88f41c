"""The collectives the parallel layers call in their forward pass (vLLM's names).

Each one runs on every rank of the TP group, in the same order on every rank (the
layers guarantee it: every rank runs the same forward). At world size 1 they return
their input untouched. A CPU graph records each call whole and makes it again at every
replay (`recorded_as_call`): the communicators keep round numbers and waits in Python.
"""

from __future__ import annotations

import torch

from distributed.native_calls import recorded_as_call
from distributed.parallel_state import get_tp_group


@recorded_as_call
def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place; returns `x`."""
    group = get_tp_group()
    if group.communicator is None:
        return x
    return group.communicator.all_reduce(x)


@recorded_as_call
def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    group = get_tp_group()
    if group.communicator is None:
        return x
    return group.communicator.all_gather(x, dim)


@recorded_as_call
def tensor_model_parallel_all_reduce_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, norm_kernel: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Sum `x` over the TP ranks, add `residual` into it in place and RMSNorm it, in one
    fused call where the communicator has one: (normed, x). None where it has none (or at
    world size 1), with nothing done: the caller then calls
    `tensor_model_parallel_all_reduce` and its own norm. `norm_kernel`: the address of a
    C function with models/layers/cpu_ops.c's `cpu_rms_norm` signature."""
    group = get_tp_group()
    if group.communicator is None:
        return None
    return group.communicator.all_reduce_rms_norm(x, residual, weight, eps, norm_kernel)
