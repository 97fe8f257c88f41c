"""Helpers shared by the parallel layers' `weight_loader`s.

A `weight_loader(param, loaded_weight[, shard_id])` is attached to every parameter. It
receives the full checkpoint tensor (often a zero-copy view of a memory-mapped file),
narrows it to this rank's slice and copies it into `param`. Narrowing before the copy
means only the bytes this rank keeps are ever read.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator

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


_ALIAS_CHECKPOINT_TENSORS: ContextVar[bool] = ContextVar("alias_checkpoint_tensors", default=False)


@contextlib.contextmanager
def alias_checkpoint_tensors() -> Iterator[None]:
    """Inside this block, `load_whole` makes a parameter a view of its checkpoint tensor
    instead of copying it, when the shapes, dtype and device match and the tensor is
    contiguous and the whole of its storage (a rank's slice of a table is copied: a view
    would hold the whole table's storage, which the memory accounting counts). Only a
    loader whose tensors are backed by a private file mapping that may outlive the load,
    or are new tensors it made and lets go of (the lazy safetensors reader, the GGUF
    loader), may enter it: the parameter then costs no copy and no anonymous memory,
    only page-cache pages."""
    token = _ALIAS_CHECKPOINT_TENSORS.set(True)
    try:
        yield
    finally:
        _ALIAS_CHECKPOINT_TENSORS.reset(token)


def load_whole(param: torch.Tensor, src: torch.Tensor, what: str = "") -> None:
    """Fill all of `param` from `src` (already this rank's slice): alias when allowed, else copy."""
    if (
        _ALIAS_CHECKPOINT_TENSORS.get()
        and isinstance(param, torch.nn.Parameter)
        and tuple(param.shape) == tuple(src.shape)
        and src.dtype == param.dtype
        and src.device == param.device
        and src.is_contiguous()
        and src.storage_offset() == 0
        and src.untyped_storage().nbytes() == src.numel() * src.element_size()
    ):
        param.data = src
        return
    copy_checked(param.data, src, what)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Load a replicated (unsharded) weight."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
        return
    load_whole(param, loaded_weight)


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
