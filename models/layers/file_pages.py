"""Handing back the page-cache pages of a dropped view of a checkpoint file.

A weight loaded whole is a view of the memory-mapped checkpoint (`alias_checkpoint_tensors`
in models/layers/weight_utils.py). When the CPU packs such a weight, the reorder reads
every page of it, so those pages are mapped into the process again, and they stay
counted in its resident memory for as long as the file's mapping lives, which is as long
as any other view of that file (a norm, the embedding) does: 0.5 GB of the 1.34 GB bf16
llama of `scripts/bench_load.py`, after packing. `release_file_pages` drops them once
the packed copy has replaced the view.

Only pages that lie wholly inside the tensor and inside a file mapping are dropped, and
a file-backed page that is read again is read back from the file. A page the process
wrote to (a private mapping's copy-on-write page) goes back to the file's contents, so
the caller passes only a tensor whose values are no longer needed as they are (packed
into their replacement), and pages shared with a neighbouring tensor are never
touched. Linux only; elsewhere, and where madvise fails, it does nothing. Called on the
loading thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import torch

_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def _file_mapping_holds(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one mapping of a file (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= start and end <= high:
                    return len(fields) == 6 and fields[4] != "0" and not fields[5].startswith("[")
    except (OSError, ValueError, IndexError):
        pass
    return False


def release_file_pages(tensor: torch.Tensor) -> int:
    """Drop the pages lying wholly inside `tensor`'s bytes from this process, if they are
    pages of a file mapping (a no-op for memory torch allocated). The tensor stays
    readable: its pages come back from the page cache. Returns the bytes released."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.numel() == 0:
        return 0
    storage = tensor.untyped_storage()
    if storage.resizable():  # torch's own allocation, not a view of a buffer such as a mapping
        return 0
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    start = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    stop = end // mmap.PAGESIZE * mmap.PAGESIZE
    libc = _libc()
    if libc is None or stop <= start or not tensor.is_contiguous() or not _file_mapping_holds(start, stop):
        return 0
    if libc.madvise(ctypes.c_void_p(start), stop - start, _MADV_DONTNEED) != 0:
        return 0
    return stop - start
