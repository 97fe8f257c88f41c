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

`release_file_pages_outside` does the same for a whole file a loader mapped, read and
copied from, once some parameters are left viewing it (the GGUF loader's aliased
weights keep its mapping alive): every page the copies read in stays counted in the
process's resident memory otherwise (0.4-0.9 GiB of an 853M Llama's GGUF files).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
from collections.abc import Iterable

import torch

_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:  # the process's own C library where ldconfig cannot name it
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) over [address, address + length) through ctypes, so other threads run
    during the call (`mmap.madvise` holds the GIL). Returns 0, or the call's errno
    (ENOSYS where there is no C library to call)."""
    libc = _libc()
    if libc is None:
        return errno.ENOSYS
    return 0 if libc.madvise(ctypes.c_void_p(address), length, advice) == 0 else ctypes.get_errno()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim(0)`, every
    arena; a no-op elsewhere). glibc keeps what torch's CPU tensors freed below its dynamic
    mmap threshold (which freeing one larger block raises, up to 32 MB): the loader's
    temporaries (40-45 MB after an 853M Llama's F16 load), a batch's activations (about
    95 MB after 16 prompts of an 853M Llama's prefill), a slept rank's weights. Its callers:
    the loader once a load is done, the worker after a sleep, and every rank once the
    serving loop is idle (`EngineCore.trim_host_memory`)."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:  # a C library without it
        pass


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
    if end // mmap.PAGESIZE * mmap.PAGESIZE <= -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE:
        return 0  # no whole page: not worth reading /proc/self/maps for
    if not tensor.is_contiguous() or not _file_mapping_holds(begin, end):
        return 0
    return _drop_pages(begin, end)


def _drop_pages(begin: int, end: int) -> int:
    """MADV_DONTNEED over the pages lying wholly inside [begin, end), which the caller
    found inside a file mapping. Returns the bytes released (0 where madvise fails)."""
    start = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    stop = end // mmap.PAGESIZE * mmap.PAGESIZE
    if stop <= start or madvise(start, stop - start, _MADV_DONTNEED) != 0:
        return 0
    return stop - start


def release_file_pages_outside(mapping: torch.Tensor, keep: Iterable[torch.Tensor]) -> int:
    """Drop the pages of `mapping` (a 1-D uint8 CPU tensor over a whole file mapping) that
    hold no byte of the storage of any tensor in `keep` (the parameters still viewing the
    file; tensors elsewhere are ignored), as `release_file_pages` drops them: only pages
    wholly between two kept storages. The caller passes a mapping whose other bytes it
    no longer needs as they are. Returns the bytes released."""
    base = mapping.data_ptr()
    end = base + mapping.numel()
    if mapping.device.type != "cpu" or not mapping.is_contiguous() or not _file_mapping_holds(base, end):
        return 0
    spans = []
    for tensor in keep:
        storage = tensor.untyped_storage()
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        if lo < end and hi > base:
            spans.append((max(lo, base), min(hi, end)))
    released, pos = 0, base
    for lo, hi in sorted(spans) + [(end, end)]:
        if lo > pos:
            released += _drop_pages(pos, lo)
        pos = max(pos, hi)
    return released
