"""PyTorch `.bin` / `.pt` checkpoints: safe, one file at a time.

Who calls this: the DefaultModelLoader on every rank, for load_format "pt", and for
"auto"/"hf" when a directory has no safetensors files (safetensors win when both
exist). npcache converts through `load_pt_file` too.

Safety: only `torch.load(..., weights_only=True)` is used. Its restricted unpickler
accepts tensors, plain containers and numbers, and refuses any other global, so a
checkpoint that pickles a custom class or a callable (e.g. a crafted `os.system`
payload) is rejected before anything runs; we turn that into a `WeightLoadError`
naming the file.

Memory: files saved in torch's zip format (the default since torch 1.6) are opened
with `mmap=True`, so a yielded tensor is a view of the mapped file and only the pages a
weight_loader copies are read; older (legacy, non-zip) files cannot be mapped and are
read whole, one file at a time. Peak: the model's parameters plus one file's mapping.
"""

from __future__ import annotations

import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from models.errors import WeightLoadError


def _is_zip_checkpoint(path: Path) -> bool:
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def load_pt_file(path: Path, mmap: bool = True) -> dict[str, torch.Tensor]:
    """{name: tensor} of one checkpoint file, loaded with `weights_only=True`.

    Raises WeightLoadError naming `path` when the file holds anything but tensors (code
    objects, custom classes), is truncated or corrupt, or is not a flat name->tensor map.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise WeightLoadError(f"{path} cannot be read: {e}") from None
    if size == 0:
        raise WeightLoadError(f"{path} is empty (0 bytes): truncated or not a PyTorch checkpoint")
    use_mmap = mmap and _is_zip_checkpoint(path)
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as e:
        raise WeightLoadError(
            f"{path} was refused: it pickles more than tensors (the weights_only unpickler rejected it: "
            f"{_unpickler_reason(e)}). Only plain tensor checkpoints are loaded; code in a checkpoint is never run"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, KeyError, struct.error) as e:
        raise WeightLoadError(
            f"{path} is not a readable PyTorch checkpoint (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from None
    if not isinstance(state, dict):
        raise WeightLoadError(f"{path} holds a {type(state).__name__}, not a dict of tensor name -> tensor")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise WeightLoadError(
                f"{path} is not a flat state dict: entry {name!r} is a {type(value).__name__}, not a tensor"
            )
    return state


def _unpickler_reason(error: Exception) -> str:
    """The specific reason from torch's long weights_only error (e.g. "Trying to load
    unsupported GLOBAL posix.system"), without its advice to retry with weights_only=False."""
    boilerplate = ("Weights only load failed", "Check the documentation", "Re-running", "Alternatively",
                   "Please file an issue", "(1)", "(2)")
    kept = []
    for line in str(error).splitlines():
        line = line.strip()
        if "WeightsUnpickler error:" in line:
            line = line.split("WeightsUnpickler error:", 1)[1].strip()
        if line and not any(line.startswith(b) or b in line[:40] for b in boilerplate):
            kept.append(line.split(". Please use")[0])
    return " ".join(kept) or type(error).__name__


def pt_weights_iterator(files: list[Path], use_tqdm: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every file, one file at a time. A file is
    released (its mapping dropped once the consumer lets go of its tensors) before the
    next one is opened."""
    for path in tqdm(files, desc="Loading pt checkpoint shards", unit="file", disable=not use_tqdm):
        state = load_pt_file(path)
        names = list(state)
        for name in names:
            yield name, state.pop(name)
        del state
