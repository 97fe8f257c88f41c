"""Multi-threaded weight iterators: several files read in parallel, tensors yielded as
files complete.

Enabled with `model_loader_extra_config={"enable_multithread_load": True,
"num_threads": 8}` (load formats auto / hf / safetensors / pt). Each thread reads one
whole file into memory (safetensors: one buffer per file, parsed from the validated
header; pt: `torch.load(weights_only=True)` without mmap, so the read happens in the
thread), and the consumer receives that file's (name, tensor) pairs as soon as it is
done, in completion order (load_weights does not depend on order).

Memory: at most `num_threads` files are read ahead of the consumer, so the peak is the
model's parameters plus about `num_threads + 1` files — more than the lazy mmap reader
(about one tensor). It pays off where reads are slow and parallel ones are not (network
filesystems, cold caches on fast NVMe); on a warm page cache the lazy reader is
usually as fast. See scripts/bench_loaders.py.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from model_loader.pt_weights import load_pt_file
from model_loader.safetensors_reader import read_safetensors_file, read_safetensors_header
from models.errors import WeightLoadError

DEFAULT_NUM_THREADS = 8
EXTRA_CONFIG_KEYS = {
    "enable_multithread_load": "bool: read several weight files in parallel threads",
    "num_threads": f"int > 0: how many threads (default {DEFAULT_NUM_THREADS})",
}


def check_extra_config_keys(extra: dict[str, Any] | None, valid: dict[str, str], load_format: str) -> None:
    """ValueError naming any key of `model_loader_extra_config` not in `valid` (a
    {key: description} map), listing the valid ones."""
    unknown = sorted(set(extra or {}) - set(valid))
    if unknown:
        described = " (" + "; ".join(f"{k}: {v}" for k, v in valid.items()) + ")" if valid else ""
        raise ValueError(
            f"model_loader_extra_config has unknown key(s) {unknown} for load_format={load_format!r}; "
            f"valid keys: {sorted(valid)}{described}"
        )


def parse_multithread_config(extra: dict[str, Any] | None, load_format: str) -> tuple[bool, int]:
    """(enabled, num_threads) from `model_loader_extra_config`; a ValueError names an
    unknown key (listing the valid ones) or a bad value."""
    extra = dict(extra or {})
    check_extra_config_keys(extra, EXTRA_CONFIG_KEYS, load_format)
    enabled = extra.get("enable_multithread_load", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"model_loader_extra_config['enable_multithread_load']={enabled!r} must be a bool")
    num_threads = extra.get("num_threads", DEFAULT_NUM_THREADS)
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads <= 0:
        raise ValueError(f"model_loader_extra_config['num_threads']={num_threads!r} must be an int > 0")
    return enabled, num_threads


def _parallel_files(
    files: list[Path],
    read: Callable[[Path], list[tuple[str, torch.Tensor]]],
    num_threads: int,
    desc: str,
    use_tqdm: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Run `read(path)` for every file in a pool with at most `num_threads` files in flight
    beyond the one being consumed; yield each file's tensors when it completes."""
    if not files:
        return
    pool = ThreadPoolExecutor(max_workers=min(num_threads, len(files)), thread_name_prefix="weights-reader")
    pending: deque[Future] = deque()
    todo = iter(files)
    progress = tqdm(total=len(files), desc=desc, unit="file", disable=not use_tqdm)
    try:
        for path in todo:
            pending.append(pool.submit(read, path))
            if len(pending) >= num_threads:
                break
        while pending:
            # Take whichever in-flight file finishes first.
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            done = next(f for f in pending if f in finished)
            pending.remove(done)
            tensors = deque(done.result())
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(read, nxt))
            progress.update(1)
            while tensors:
                name, tensor = tensors.popleft()
                yield name, tensor
            del tensors
    finally:
        progress.close()
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def multi_thread_safetensors_weights_iterator(
    files: list[Path], num_threads: int = DEFAULT_NUM_THREADS, use_tqdm: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `safetensors_weights_iterator`, with files read whole by parallel threads.
    Every header is validated before the first read, so a truncated file fails fast."""
    headers = {path: read_safetensors_header(path)[0] for path in files}

    def read(path: Path) -> list[tuple[str, torch.Tensor]]:
        return read_safetensors_file(path, headers[path])

    yield from _parallel_files(files, read, num_threads, "Loading safetensors shards (threads)", use_tqdm)


def multi_thread_pt_weights_iterator(
    files: list[Path], num_threads: int = DEFAULT_NUM_THREADS, use_tqdm: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Like `pt_weights_iterator`, with files loaded (weights_only=True, fully read) by
    parallel threads."""

    def read(path: Path) -> list[tuple[str, torch.Tensor]]:
        state = load_pt_file(path, mmap=False)
        return list(state.items())

    yield from _parallel_files(files, read, num_threads, "Loading pt checkpoint shards (threads)", use_tqdm)


__all__ = [
    "check_extra_config_keys",
    "DEFAULT_NUM_THREADS",
    "EXTRA_CONFIG_KEYS",
    "WeightLoadError",
    "multi_thread_pt_weights_iterator",
    "multi_thread_safetensors_weights_iterator",
    "parse_multithread_config",
]
