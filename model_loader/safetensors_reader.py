"""A zero-copy safetensors reader over mmap, and the weight iterators built on it.

Who calls this: the DefaultModelLoader on every rank. Memory contract: a yielded tensor
is a view of the memory-mapped file, so nothing is copied until a `weight_loader`
copies this rank's slice into its parameter, and only the pages of that slice are read.
Once the consumer moves on, the previous tensor's pages are dropped from this process
(madvise DONTNEED), so peak memory is the model's parameters plus about one tensor.
The "eager" strategy instead reads a whole file into one buffer first (peak: one
file); "prefetch" warms the page cache with background threads ahead of the reader.

Only tensor bytes are interpreted: the header is JSON, nothing is unpickled.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from models.errors import WeightLoadError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * (1 << 20)
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_safetensors_header(path: Path) -> tuple[list[TensorEntry], dict[str, str]]:
    """Parse and validate the header; raises WeightLoadError naming `path` (and the
    tensor at fault) when the file is truncated or corrupt, or uses an unknown dtype.

    Checked before anything is allocated or mapped: the 8-byte header length (at most
    100 MiB, and inside the file), then per tensor its dtype, shape (integers >= 0) and
    byte range (inside the data section, matching the shape); ranges of different
    tensors must not overlap. Entries come in file order."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise WeightLoadError(f"{path} is truncated: {file_size} bytes, no safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            # Both checks come before the read: a corrupt length must not allocate its size.
            if header_len > _MAX_HEADER_BYTES:
                raise WeightLoadError(
                    f"{path} is corrupt or not a safetensors file: its header length {header_len} exceeds the "
                    f"{_MAX_HEADER_BYTES >> 20} MiB limit"
                )
            if header_len > file_size - 8:
                raise WeightLoadError(
                    f"{path} is corrupt or truncated: header length {header_len} > file size {file_size}"
                )
            header = json.loads(f.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightLoadError(f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise WeightLoadError(f"{path} is corrupt: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WeightLoadError(f"{path} is corrupt: __metadata__ is not a map of strings to strings")
    data_start = 8 + header_len
    data_size = file_size - data_start
    entries = []
    for name, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(_header_int(d) for d in info["shape"])
            begin, end = (_header_int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightLoadError(f"{path} is corrupt or uses an unsupported dtype at tensor {name!r}: {e!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin > end:
            raise WeightLoadError(
                f"{path} is corrupt: tensor {name!r} byte range [{begin}, {end}) does not match its shape {shape} "
                f"and dtype {info['dtype']}"
            )
        if end > data_size:
            raise WeightLoadError(
                f"{path} is truncated or corrupt: tensor {name!r} ends at byte {data_start + end} but the file has "
                f"{file_size}"
            )
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, data_start + end))
    entries.sort(key=lambda e: (e.begin, e.end))
    # Overlapping ranges would alias two parameters' bytes (and our in-place consumers would
    # corrupt each other); the format forbids them.
    previous: TensorEntry | None = None
    for entry in entries:
        if entry.end == entry.begin:
            continue
        if previous is not None and entry.begin < previous.end:
            raise WeightLoadError(
                f"{path} is corrupt: tensors {previous.name!r} (bytes [{previous.begin - data_start}, "
                f"{previous.end - data_start})) and {entry.name!r} (bytes [{entry.begin - data_start}, "
                f"{entry.end - data_start})) overlap"
            )
        previous = entry
    return entries, metadata


def _header_int(value: object) -> int:
    """A shape dimension or byte offset: a JSON integer >= 0 (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    if value < 0:
        raise ValueError(f"{value!r} is negative")
    return value


def _tensor_from_buffer(buffer: object, entry: TensorEntry, base: int = 0) -> torch.Tensor:
    numel = (entry.end - entry.begin) // entry.dtype.itemsize
    if numel == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    flat = torch.frombuffer(buffer, dtype=entry.dtype, count=numel, offset=entry.begin - base)
    return flat.view(entry.shape)


def _iterate_mmap(path: Path, entries: list[TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    with open(path, "rb") as f:
        # ACCESS_COPY gives a writable (private) mapping, which torch.frombuffer wants;
        # we never write to it, so no page is ever copied.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for entry in entries:
        yield entry.name, _tensor_from_buffer(mm, entry)
        start = entry.begin - entry.begin % _PAGE
        if entry.end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, entry.end - start)
    # Views handed out may still be alive; the mapping is released when the last one is.


def _iterate_eager(path: Path, entries: list[TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    if not entries:
        return
    base = entries[0].begin
    buffer = bytearray(entries[-1].end - base)
    with open(path, "rb") as f:
        f.seek(base)
        if f.readinto(buffer) != len(buffer):
            raise WeightLoadError(f"{path} is truncated: short read")
    for entry in entries:
        yield entry.name, _tensor_from_buffer(buffer, entry, base)


def read_safetensors_file(path: Path, entries: list[TensorEntry] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Read one file's tensor bytes into a single private buffer (one `readinto`, which
    releases the GIL, so threads can read files in parallel) and return (name, tensor)
    views of it. `entries` from `read_safetensors_header` skips re-parsing the header.
    Used by the multi-threaded iterator; peak memory is the file's size."""
    if entries is None:
        entries = read_safetensors_header(path)[0]
    return list(_iterate_eager(path, entries))


def _prefetch_file(path: Path, block_size: int, num_threads: int) -> None:
    """Read the file once in blocks, in parallel, so later page faults hit the page cache."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        local = threading.local()

        def read_block(offset: int) -> None:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(block_size)
            os.preadv(fd, [memoryview(buf)[: min(block_size, size - offset)]], offset)

        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            list(pool.map(read_block, range(0, size, block_size)))
    finally:
        os.close(fd)


_NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs", "gpfs", "9p")


def is_network_filesystem(path: Path) -> bool:
    """True when `path` lives on a filesystem type from /proc/mounts that is remote."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    resolved, best, fstype = str(path.resolve()), "", ""
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype in _NETWORK_FILESYSTEMS or fstype.startswith("fuse.")


def safetensors_weights_iterator(
    files: list[Path],
    strategy: str | None = None,
    prefetch_num_threads: int = 8,
    prefetch_block_size: int = 16 << 20,
    use_tqdm: bool = False,
    name_filter: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of every file, file by file.

    `name_filter` (a MoE model's expert-parallel filter): names it rejects are dropped
    from the headers, before anything is mapped; on the "lazy" strategy none of their
    bytes is ever read ("eager" and "prefetch" read whole files by design).

    `strategy`: "lazy" (mmap views), "eager" (whole file read up front) or "prefetch"
    (page cache warmed one file ahead by `prefetch_num_threads` threads); None picks
    "prefetch" on network filesystems and "lazy" elsewhere. Every header is validated
    before the first tensor is yielded, so a truncated shard fails fast, by name.
    """
    if strategy is None:
        strategy = "prefetch" if files and is_network_filesystem(files[0]) else "lazy"
    headers = [(path, [e for e in read_safetensors_header(path)[0] if name_filter is None or name_filter(e.name)])
               for path in files]
    prefetcher: ThreadPoolExecutor | None = None
    pending = None
    if strategy == "prefetch":
        prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safetensors-prefetch")
        pending = prefetcher.submit(_prefetch_file, files[0], prefetch_block_size, prefetch_num_threads) if files else None
    try:
        progress = tqdm(headers, desc="Loading safetensors shards", unit="file", disable=not use_tqdm)
        for i, (path, entries) in enumerate(progress):
            if prefetcher is not None:
                if pending is not None:
                    pending.result()
                pending = (
                    prefetcher.submit(_prefetch_file, files[i + 1], prefetch_block_size, prefetch_num_threads)
                    if i + 1 < len(files)
                    else None
                )
            if strategy == "eager":
                yield from _iterate_eager(path, entries)
            else:
                yield from _iterate_mmap(path, entries)
    finally:
        if prefetcher is not None:
            prefetcher.shutdown(wait=True, cancel_futures=True)
