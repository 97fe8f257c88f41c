"""ShardedStateLoader (load_format="sharded_state"): per-rank pre-sharded checkpoints.

Saving: `EngineCore.save_sharded_state(path, max_size=None)` (or
`scripts/save_sharded_state.py MODEL OUT --tp N`) makes every rank's
`Worker.save_sharded_state` write its own
`state_dict()` — exactly its TP shard — to `model-rank-{rank}-part-{part}.safetensors`,
split into parts of at most `max_size` bytes (a tensor larger than that gets a part of
its own), and copies config.json, generation_config.json and the tokenizer files next
to them. Tensors that share storage (tied embeddings: `lm_head.weight` is
`model.embed_tokens.weight`) are written once, under the first name. Every file's
safetensors metadata records `tp_size`, `rank`, `part` and `num_parts`.

Loading: each rank reads only its own files (glob `model-rank-{rank}-part-*.safetensors`,
memory-mapped like the default loader) and copies each tensor by key straight into the
parameter of the same name — no checkpoint-name mapping, no TP slicing. Strict: a
missing or unexpected key, a shape mismatch or a non-float tensor for a float
parameter is a `WeightLoadError` naming them. A checkpoint saved at one TP size and
loaded at another fails clearly: the metadata's `tp_size` is checked, and a rank whose
file is absent reports "missing rank file" with the ranks that are present; a missing
part is named too.

Memory: parameters plus about one tensor (mmap views, like the "lazy" strategy).
Saving holds no extra copy: tensors are streamed to the file one at a time (a weight
held in the CPU's packed layout is written as its plain values, unpacked one at a time).
Loading into a model whose weights are packed (`update_weights`) packs each again as it
is copied in.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from model_loader.base_loader import BaseModelLoader
from model_loader.multithread import check_extra_config_keys
from model_loader.safetensors_reader import SAFETENSORS_DTYPES, read_safetensors_header, safetensors_weights_iterator
from model_loader.weight_files import CONFIG_PATTERNS, WEIGHT_FILE_PATTERNS
from models.errors import WeightLoadError
from models.layers.packed_tensor import PackedTensor
from models.utils import format_names

if TYPE_CHECKING:
    from config import LoadConfig, ModelConfig

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
_FILE_RE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


# ----------------------------------------------------------------------------- state


def shardable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` (parameters and persistent buffers) with tensors that share
    storage kept once, under their first name. Saving and loading use the same rule, so
    the keys line up."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[object, ...], str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor is None:
            continue
        t = tensor.detach()
        if t.numel() == 0:
            out[name] = t
            continue
        key = _storage_key(t)
        if key in seen:
            continue
        seen[key] = name
        out[name] = t
    return out


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    """What two tensors that share their data have in common: the storage and the view,
    or, for a weight held in a packed layout (`PackedTensor`), the packed data."""
    if isinstance(t, PackedTensor):
        return ("packed", id(t.packed_weight))
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


# ----------------------------------------------------------------------------- saving


def _write_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Write a safetensors file tensor by tensor (no whole-file buffer), atomically."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for _, t in tensors:
                if t.numel():
                    t = t.plain() if isinstance(t, PackedTensor) else t  # one weight unpacked at a time
                    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                    f.write(memoryview(data.numpy()))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_sharded_model(
    model: nn.Module, path: str | os.PathLike[str], rank: int, tp_size: int, max_size: int | None = None
) -> list[str]:
    """Write this rank's state to `path/model-rank-{rank}-part-{part}.safetensors`;
    returns the file names. Removes this rank's files of an earlier save first."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"model-rank-{rank}-part-*.safetensors"):
        stale.unlink()
    state = shardable_state(model)
    parts: list[list[tuple[str, torch.Tensor]]] = [[]]
    part_bytes = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_size is not None and parts[-1] and part_bytes + nbytes > max_size:
            parts.append([])
            part_bytes = 0
        parts[-1].append((name, t))
        part_bytes += nbytes
    names = []
    for part, tensors in enumerate(parts):
        file_name = DEFAULT_PATTERN.format(rank=rank, part=part)
        metadata = {"format": "pt", "tp_size": str(tp_size), "rank": str(rank), "part": str(part),
                    "num_parts": str(len(parts))}
        _write_safetensors(out / file_name, tensors, metadata)
        names.append(file_name)
    return names


def is_weight_file(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in WEIGHT_FILE_PATTERNS)


def copy_model_metadata_files(model_dir: str | os.PathLike[str], path: str | os.PathLike[str]) -> list[str]:
    """Copy config.json, generation_config.json and tokenizer files (every top-level
    file matching `CONFIG_PATTERNS` that holds no weights) from `model_dir` to `path`.
    Symlinks (Hub cache snapshots) are followed."""
    src, dst = Path(model_dir), Path(path)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not is_weight_file(f.name) and any(fnmatch.fnmatch(f.name, p) for p in CONFIG_PATTERNS):
            try:
                shutil.copyfile(f, dst / f.name)
            except shutil.SameFileError:
                pass
            copied.append(f.name)
    return copied


def remove_sharded_state_files(path: str | os.PathLike[str]) -> None:
    """Delete every `model-rank-*-part-*.safetensors` in `path` (before a fresh save, so
    files of an earlier save at another TP size cannot mix in)."""
    p = Path(path)
    if p.is_dir():
        for f in p.iterdir():
            if _FILE_RE.match(f.name):
                f.unlink()


# ----------------------------------------------------------------------------- loading


def _rank_files(model_dir: Path, ignore_patterns: Iterable[str]) -> dict[int, dict[int, Path]]:
    """{rank: {part: path}} of every sharded-state file in `model_dir`."""
    found: dict[int, dict[int, Path]] = {}
    ignore = list(ignore_patterns)
    for f in model_dir.iterdir():
        m = _FILE_RE.match(f.name)
        if m and f.is_file() and not any(fnmatch.fnmatch(f.name, p) for p in ignore):
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
    return found


def sharded_state_files(model_dir: Path, rank: int, tp_size: int, ignore_patterns: Iterable[str] = ()) -> list[Path]:
    """This rank's files, in part order, after checking that the checkpoint was saved at
    `tp_size` and is complete for this rank. Raises WeightLoadError otherwise."""
    found = _rank_files(model_dir, ignore_patterns)
    if not found:
        raise WeightLoadError(
            f"no sharded_state files (model-rank-<rank>-part-<part>.safetensors) in {model_dir}; "
            "write them with scripts/save_sharded_state.py or EngineCore.save_sharded_state()"
        )
    ranks = sorted(found)
    any_file = found[ranks[0]][min(found[ranks[0]])]
    saved_tp = read_safetensors_header(any_file)[1].get("tp_size")
    saved_desc = f"saved with tensor_parallel_size={saved_tp}" if saved_tp else f"has files for ranks {ranks}"
    if rank not in found:
        raise WeightLoadError(
            f"missing rank file: {model_dir} has no model-rank-{rank}-part-*.safetensors for TP rank {rank} "
            f"(files exist for ranks {ranks}); the checkpoint {saved_desc}, this engine runs "
            f"tensor_parallel_size={tp_size}. Re-save it at tp={tp_size}"
        )
    extra = [r for r in ranks if r >= tp_size]
    if extra:
        raise WeightLoadError(
            f"{model_dir} holds sharded_state files for ranks {ranks}, but this engine runs "
            f"tensor_parallel_size={tp_size} (ranks 0..{tp_size - 1}); the checkpoint {saved_desc}. "
            f"Re-save it at tp={tp_size}"
        )
    parts = found[rank]
    files = [parts[p] for p in sorted(parts)]
    for f in files:
        meta = read_safetensors_header(f)[1]
        if "tp_size" in meta and int(meta["tp_size"]) != tp_size:
            raise WeightLoadError(
                f"{f} was saved with tensor_parallel_size={meta['tp_size']}, but this engine runs "
                f"tensor_parallel_size={tp_size}; re-save the checkpoint at tp={tp_size}"
            )
        if "rank" in meta and int(meta["rank"]) != rank:
            raise WeightLoadError(f"{f} records rank {meta['rank']} in its metadata, not {rank}: renamed file?")
        if "num_parts" in meta:
            expected = set(range(int(meta["num_parts"])))
            missing = sorted(expected - set(parts))
            if missing:
                names = [DEFAULT_PATTERN.format(rank=rank, part=p) for p in missing]
                raise WeightLoadError(f"{model_dir} is missing part file(s) {names} of rank {rank}")
    return files


class ShardedStateLoader(BaseModelLoader):
    """Loads `model-rank-{rank}-part-*.safetensors` by key; see the module docstring."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        check_extra_config_keys(load_config.model_loader_extra_config, {}, load_config.load_format)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        model_dir = Path(model_config.model)
        rank = get_tensor_model_parallel_rank()
        tp_size = get_tensor_model_parallel_world_size()
        files = sharded_state_files(model_dir, rank, tp_size, self.load_config.ignore_patterns)
        expected = shardable_state(model)
        loaded: set[str] = set()
        unexpected: list[str] = []
        weights = safetensors_weights_iterator(
            files,
            strategy=self.load_config.safetensors_load_strategy,
            prefetch_num_threads=self.load_config.safetensors_prefetch_num_threads,
            prefetch_block_size=self.load_config.safetensors_prefetch_block_size,
        )
        if self.load_config.check_weights_finite:
            from model_loader.default_loader import warn_non_finite_weights

            weights = warn_non_finite_weights(weights, files, safetensors=True)
        for name, tensor in weights:
            target = expected.get(name)
            if target is None:
                unexpected.append(name)
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"sharded_state tensor {name!r} (rank {rank}) has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(target.shape)}: saved from a different model or TP size?"
                )
            if target.is_floating_point() and not tensor.is_floating_point():
                raise WeightLoadError(
                    f"sharded_state tensor {name!r} (rank {rank}) has dtype {tensor.dtype}, but the parameter is "
                    f"{target.dtype}: the checkpoint is corrupt or not for this model"
                )
            target.copy_(tensor)
            loaded.add(name)
        missing = set(expected) - loaded
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"{len(missing)} tensor(s) missing: {format_names(missing)}")
            if unexpected:
                parts.append(f"{len(unexpected)} unexpected tensor(s): {format_names(unexpected)}")
            raise WeightLoadError(
                f"sharded_state checkpoint {model_dir} (rank {rank}) does not match {type(model).__name__}: "
                + "; ".join(parts)
            )
