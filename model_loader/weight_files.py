"""Find the weight files of a local model directory for a given load_format.

Called on every rank by the loaders (after the engine has downloaded Hub models). It
reads only directory listings and the small index JSON. Raises `WeightLoadError`
naming the directory, the patterns or the missing file.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from models.errors import WeightLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"

ALLOW_PATTERNS: dict[str, list[str]] = {
    "auto": ["*.safetensors", "*.bin"],
    "hf": ["*.safetensors", "*.bin"],
    "safetensors": ["*.safetensors"],
    "pt": ["*.pt", "*.bin"],
    "npcache": ["*.bin"],
    # Written by EngineCore.save_sharded_state (scripts/save_sharded_state.py); one set per TP rank.
    "sharded_state": ["model-rank-*-part-*.safetensors"],
    # Random weights: nothing to read or download but config.json.
    "dummy": [],
    "gguf": ["*.gguf"],
}

# Non-weight files a model directory needs besides its weights: config, generation
# config, tokenizer. `engine.hub` downloads these for every load format, and
# `save_sharded_state` copies them next to the sharded weights.
CONFIG_PATTERNS: list[str] = [
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
]

# Files that hold weights in some format; never copied as "metadata".
WEIGHT_FILE_PATTERNS: list[str] = [
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.gguf",
    "*.npy",
    "*.safetensors.index.json",
    "*.bin.index.json",
]

# Files that match the patterns but hold optimizer or trainer state, never weights.
TRAINING_FILES = frozenset(
    {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "trainer_state.bin"}
)


def _is_ignored(rel_path: str, ignore_patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(rel_path, pattern) for pattern in ignore_patterns)


def filter_by_safetensors_index(model_dir: Path, files: list[Path]) -> list[Path]:
    """Keep only the shards that the index's weight_map names (drops stray or
    consolidated duplicates). Raises WeightLoadError naming the index when it is not
    valid JSON, when an entry is not a bare file name of `model_dir` (`../x`, an
    absolute path or a subdirectory: nothing outside the model directory is ever
    opened), or when a shard it names does not exist."""
    index_path = model_dir / SAFETENSORS_INDEX
    if not index_path.is_file():
        return files
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightLoadError(f"{index_path} is not a valid safetensors index: {e!r}") from None
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise WeightLoadError(
                f"{index_path} is not a valid safetensors index: weight_map[{tensor!r}] is {shard!r}, not a file name"
            )
        # Checked on the name, not the resolved path: Hub snapshots are symlinks into a blob
        # store, which is fine; a name that leaves the directory is not.
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard or shard != Path(shard).name:
            raise WeightLoadError(
                f"{index_path}: weight_map[{tensor!r}] = {shard!r} points outside the model directory {model_dir}; "
                "shards must be file names in that directory"
            )
    wanted = set(weight_map.values())
    missing = sorted(name for name in wanted if not (model_dir / name).is_file())
    if missing:
        raise WeightLoadError(f"{index_path} references shard(s) {missing} that do not exist in {model_dir}")
    return [f for f in files if f.name in wanted]


def prepare_weight_files(model_dir: Path, load_format: str, ignore_patterns: list[str]) -> tuple[list[Path], bool]:
    """(sorted weight files, whether they are safetensors) for `load_format`.

    With "auto"/"hf", safetensors files win when any exist; otherwise `.bin` files are used.
    """
    patterns = ALLOW_PATTERNS.get(load_format, ALLOW_PATTERNS["auto"])
    for pattern in patterns:
        files = sorted(
            p
            for p in model_dir.glob(pattern)
            if p.is_file() and p.name not in TRAINING_FILES and not _is_ignored(p.name, ignore_patterns)
        )
        if files:
            break
    else:
        raise WeightLoadError(
            f"no weight files matching {patterns} (load_format={load_format!r}) found in {model_dir}"
        )
    use_safetensors = pattern == "*.safetensors"
    if use_safetensors:
        files = filter_by_safetensors_index(model_dir, files)
    return files, use_safetensors
