"""Helpers shared by the parallel layers' `weight_loader`s.

A `weight_loader(param, loaded_weight[, shard_id])` is attached to every parameter. It
receives the full checkpoint tensor (often a zero-copy view of a memory-mapped file),
narrows it to this rank's slice and copies it into `param`. Narrowing before the copy
means only the bytes this rank keeps are ever read.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from models.errors import WeightLoadError


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str = "") -> None:
    """Copy `src` into `dst`, raising `WeightLoadError` with both shapes on a mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        where = f" ({what})" if what else ""
        raise WeightLoadError(
            f"shape mismatch{where}: the model expects {tuple(dst.shape)}, "
            f"the checkpoint slice has {tuple(src.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a replicated (unsharded) weight."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
        return
    copy_checked(param.data, loaded_weight)


def narrow_for_rank(
    loaded_weight: torch.Tensor, dim: int, shard_size: int, shard_rank: int, what: str
) -> torch.Tensor:
    """This rank's `shard_size`-wide slice of `loaded_weight` along `dim`."""
    start = shard_rank * shard_size
    if loaded_weight.dim() <= dim or loaded_weight.shape[dim] < start + shard_size:
        raise WeightLoadError(
            f"shape mismatch ({what}): cannot take rows [{start}, {start + shard_size}) "
            f"of dim {dim} from a checkpoint tensor of shape {tuple(loaded_weight.shape)}"
        )
    return loaded_weight.narrow(dim, start, shard_size)


WeightLoader = Callable[..., None]
