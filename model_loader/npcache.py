"""load_format="npcache": convert `.bin` checkpoints once to a numpy cache, then map it.

Who calls this: the DefaultModelLoader on every rank. The first load converts every
`.bin` file (read safely through `pt_weights.load_pt_file`, i.e. `weights_only=True`)
into one `.npy` file per tensor; later loads (and the other ranks, which wait on the
lock) memory-map those files with `np.load(mmap_mode="c")` and hand out
`torch.from_numpy` views, so nothing is unpickled again and only the pages a
weight_loader copies are read.

Where the cache lives: `<model dir>/np`, or `<download_dir>/npcache/<model>-<hash of
its path>` when `download_dir` is set (so two models never share a cache). The
conversion runs under a cross-process `filelock` (`<cache>.lock`), into a temporary
directory renamed into place when complete, so a crash never leaves a half cache. A
`manifest.json` records the source files (name, size, mtime); when they change the
cache is rebuilt.

bfloat16 (and float8): numpy has no such dtypes. Those tensors are stored as their raw
bits (`tensor.view(torch.uint16)` / `uint8`) and the manifest, the dtype sidecar,
records the real torch dtype; loading views the bits back (`.view(torch.bfloat16)`),
so values are bit-exact and no conversion happens on either side.

`mmap_mode="c"` (copy-on-write) rather than "r": the mapping is still read lazily
from the page cache and never copied (weight loaders only read), but the array is
writable, so `torch.from_numpy` does not warn about, or crash on, a read-only buffer.

Memory while converting: one `.bin` file mapped (zip checkpoints) plus one tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from filelock import FileLock

from model_loader.pt_weights import load_pt_file
from models.errors import WeightLoadError

MANIFEST = "manifest.json"
_FORMAT_VERSION = 1

# torch dtypes numpy cannot hold: stored as same-width unsigned ints, restored by view.
_BITS_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.uint16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


def np_cache_dir(model_dir: Path, download_dir: str | None) -> Path:
    """Where the numpy cache of `model_dir` lives (see the module docstring)."""
    if download_dir is None:
        return model_dir / "np"
    resolved = str(model_dir.resolve())
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:12]
    return Path(download_dir) / "npcache" / f"{model_dir.name}-{digest}"


def _source_signature(files: list[Path]) -> list[dict[str, Any]]:
    sig = []
    for f in files:
        st = f.stat()
        sig.append({"name": f.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return sig


def _read_manifest(cache_dir: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((cache_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("version") == _FORMAT_VERSION else None


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    bits = _BITS_DTYPES.get(tensor.dtype)
    if bits is not None:
        tensor = tensor.view(bits)
    return tensor.numpy()


def _convert(files: list[Path], cache_dir: Path, signature: list[dict[str, Any]]) -> None:
    tmp = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors: list[dict[str, Any]] = []
        seen: dict[str, Path] = {}
        for path in files:
            state = load_pt_file(path)
            for name in list(state):
                tensor = state.pop(name)
                if name in seen:
                    raise WeightLoadError(f"tensor {name!r} appears in both {seen[name]} and {path}")
                seen[name] = path
                file_name = f"{len(tensors):06d}.npy"
                np.save(tmp / file_name, _to_numpy(tensor), allow_pickle=False)
                tensors.append({
                    "name": name,
                    "file": file_name,
                    "dtype": str(tensor.dtype).removeprefix("torch."),
                    "shape": list(tensor.shape),
                    "source": path.name,
                })
                del tensor
            del state
        manifest = {"version": _FORMAT_VERSION, "sources": signature, "tensors": tensors}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        os.replace(tmp, cache_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_np_cache(files: list[Path], cache_dir: Path) -> dict[str, Any]:
    """Convert `files` into `cache_dir` unless an up-to-date cache is there; returns the
    manifest. Safe to call from every rank at once: one converts, the others wait."""
    signature = _source_signature(files)
    manifest = _read_manifest(cache_dir)
    if manifest is not None and manifest["sources"] == signature:
        return manifest
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(str(cache_dir.with_name(cache_dir.name + ".lock")))
        with lock:
            manifest = _read_manifest(cache_dir)  # another process may have finished meanwhile
            if manifest is None or manifest["sources"] != signature:
                _convert(files, cache_dir, signature)
                manifest = _read_manifest(cache_dir)
    except OSError as e:
        raise WeightLoadError(f"cannot write the npcache at {cache_dir}: {e}") from None
    if manifest is None:
        raise WeightLoadError(f"the npcache at {cache_dir} has no valid {MANIFEST} after conversion")
    return manifest


def _load_entry(cache_dir: Path, entry: dict[str, Any]) -> torch.Tensor:
    path = cache_dir / entry["file"]
    dtype = _TORCH_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise WeightLoadError(f"npcache {cache_dir / MANIFEST}: unknown dtype {entry['dtype']!r} for {entry['name']!r}")
    try:
        array = np.load(path, mmap_mode="c", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise WeightLoadError(
            f"npcache file {path} (tensor {entry['name']!r}) is unreadable or truncated: {e}; "
            f"delete {cache_dir} to rebuild the cache"
        ) from None
    if list(array.shape) != list(entry["shape"]):
        raise WeightLoadError(
            f"npcache file {path} has shape {list(array.shape)}, its manifest says {entry['shape']}; "
            f"delete {cache_dir} to rebuild the cache"
        )
    if array.ndim == 0 or array.size == 0:
        array = np.array(array)  # tiny: a real array, no mapping to keep alive
    tensor = torch.from_numpy(array)
    if dtype in _BITS_DTYPES:
        tensor = tensor.view(dtype)
    if tensor.dtype != dtype:
        raise WeightLoadError(f"npcache file {path} holds {tensor.dtype}, its manifest says {dtype}")
    return tensor


def np_cache_weights_iterator(
    model_dir: Path, download_dir: str | None, files: list[Path]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from the numpy cache of `files`, building it first if needed."""
    cache_dir = np_cache_dir(model_dir, download_dir)
    manifest = ensure_np_cache(files, cache_dir)
    for entry in manifest["tensors"]:
        yield entry["name"], _load_entry(cache_dir, entry)
