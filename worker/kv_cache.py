"""KV cache sizing and allocation.

Each rank reports the `KVCacheSpec` of its model, derived from its attention layers (so
no other code computes heads per rank or the head size); the engine checks the ranks
agree, computes `KVCacheConfig` from the smallest per-rank memory report, and every
rank then allocates the same number of blocks, one tensor per layer in the layout of
its attention backend.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
from dataclasses import dataclass

import torch

from models.layers import file_pages
from worker.sleep_mode import ReleasedStorages, unique_storages


class KVCacheTooSmallError(RuntimeError):
    """The memory left for the KV cache cannot hold one sequence of max_model_len."""


@dataclass(frozen=True)
class KVCacheSpec:
    """What one block of the cache holds on one rank, for every layer."""

    num_layers: int
    block_size: int
    num_kv_heads_per_rank: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers on one rank (K and V)."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads_per_rank * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class KVCacheConfig(KVCacheSpec):
    """The spec plus the block count the engine chose; identical on every rank."""

    num_blocks: int

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, num_blocks: int) -> KVCacheConfig:
        return cls(spec.num_layers, spec.block_size, spec.num_kv_heads_per_rank, spec.head_dim, spec.dtype,
                   num_blocks)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, num_layers: int,
                      device: torch.device) -> KVCacheMemory:
    """One zeroed tensor of `shape` per layer, in host memory (`HostKVCache`) on the CPU,
    else torch's allocator (`DeviceKVCache`). Called by the ModelRunner on every rank,
    with the same arguments on every rank."""
    if device.type == "cpu" and sys.platform.startswith("linux"):
        return HostKVCache(shape, dtype, num_layers)
    return DeviceKVCache(shape, dtype, num_layers, device)


class KVCacheMemory:
    """One rank's paged KV cache: `tensors` (one per layer, bound to the layers) and the
    memory behind them, which sleep mode hands back (`release`) and gets back zeroed
    (`restore`) while every tensor stays the same object. Used by one thread, the
    rank's own (the ModelRunner's); `nbytes` is the size of all layers together."""

    tensors: list[torch.Tensor]
    nbytes: int
    allocated: bool

    def release(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def wait_committed(self) -> None:
        """Return once every page is backed by memory (what the process's RSS shows)."""


class DeviceKVCache(KVCacheMemory):
    """torch.zeros per layer. Zeroing touches every page, so the memory is committed
    now rather than at the first long request. Release shrinks the storages to zero
    bytes and restore grows them back zeroed (sleep_mode.ReleasedStorages)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, device: torch.device) -> None:
        self.tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.nbytes = sum(t.untyped_storage().nbytes() for t in self.tensors)
        self.allocated = True
        self._released: ReleasedStorages | None = None

    def release(self) -> None:
        self._released = ReleasedStorages(unique_storages(self.tensors), offload=False)
        self.allocated = False

    def restore(self) -> None:
        if self._released is not None:
            self._released.restore()
            self._released = None
        self.allocated = True


_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without writing to them


def madvise(tensor: torch.Tensor, advice: int, nbytes: int | None = None) -> None:
    """madvise(2) over the first `nbytes` (default all) of `tensor`'s page-aligned memory.
    Through ctypes, which lets other threads run during the call; `mmap.madvise` holds
    the GIL, and committing 1 GiB that way froze the rank's other threads for 0.6 s.
    Raises OSError with the call's errno."""
    length = tensor.untyped_storage().nbytes() if nbytes is None else nbytes
    err = file_pages.madvise(tensor.data_ptr(), length, advice)
    if err != 0:
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


class HostKVCache(KVCacheMemory):
    """The CPU's cache (Linux): one private anonymous mapping per layer, which the kernel
    hands out zero-filled, so nothing has to write zeros.

    Committing its pages (about 0.4-0.8 s per GiB on the 2-core dev VMs, the largest
    part of a TP=2 start after the spawn) runs on a background thread with
    madvise(MADV_POPULATE_WRITE), which faults pages in without writing to them, so
    the rank serves while it runs and the model's writes are never clobbered. Within
    about a second of start-up the memory is committed as torch.zeros would have done
    at once; `wait_committed` joins it (sleep mode does, before it measures memory).
    A kernel without that advice (before 5.14) refuses it at the first call, and the
    commit then writes zeros itself: before the constructor returns, while nothing
    else uses the cache. Release is madvise(MADV_DONTNEED), after which every page
    reads as zero again; restore commits again.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int) -> None:
        layer_bytes = math.prod(shape) * dtype.itemsize
        # Each tensor keeps its mapping alive (frombuffer holds the buffer), so no list of them.
        self.tensors = [torch.frombuffer(mmap.mmap(-1, layer_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                                         dtype=dtype).view(shape) for _ in range(num_layers)]
        self.nbytes = layer_bytes * num_layers
        self.allocated = True
        self._committer: threading.Thread | None = None
        self._commit()

    def _commit(self) -> None:
        try:
            madvise(self.tensors[0], _MADV_POPULATE_WRITE, mmap.PAGESIZE)  # whether the kernel knows it
        except OSError:  # EINVAL: an older kernel; nothing else touches the cache yet
            for tensor in self.tensors:
                tensor.zero_()
            return
        self._committer = threading.Thread(target=_populate, args=(list(self.tensors),), name="kv-commit",
                                           daemon=True)
        self._committer.start()

    def wait_committed(self) -> None:
        if self._committer is not None:
            self._committer.join()
            self._committer = None

    def release(self) -> None:
        self.wait_committed()
        for tensor in self.tensors:
            madvise(tensor, _MADV_DONTNEED)
        self.allocated = False

    def restore(self) -> None:
        self.allocated = True
        self._commit()


def _populate(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        madvise(tensor, _MADV_POPULATE_WRITE)
