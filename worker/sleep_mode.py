"""Sleep mode on one rank: hand the memory of the "weights" and "kv_cache" pools back,
and get it back.

Called by the Worker (`Worker.sleep` / `Worker.wake_up`), on every rank, between steps,
with the same arguments on every rank. A pool's memory is released while every tensor
and view of it (a layer's bound KV cache, tied embeddings, a parameter's alias) stays
the same Python object, and restored under it, inside the same memory pool, so nothing
that holds a reference has to be told.

- KV cache: discarded on sleep (level 1 and 2), zeroed again on wake-up, by its own
  `KVCacheMemory` (worker/kv_cache.py): on the CPU madvise on its mappings, elsewhere
  storages shrunk to zero bytes and grown back (`UntypedStorage.resize_`).
- Weights, level 1: on CUDA each storage is copied to pinned host memory first, shrunk
  to zero bytes (`ReleasedStorages`), and grown back and copied back on wake-up; on
  the CPU the weights already live in host memory and stay.
- Weights, level 2: the model is dropped altogether (its parameters may alias the
  checkpoint's file mapping, which only unmapping frees) and rebuilt on wake-up by the
  same loader and load format. The ModelRunner does that part.

Why our own code: vLLM's CuMemAllocator needs a CUDA extension and exists for CUDA only;
resizing storages works for both devices and any tensor torch allocated.
"""

from __future__ import annotations

import enum
import gc
from collections.abc import Iterable

import torch

TAGS = ("weights", "kv_cache")


class PoolState(enum.Enum):
    AWAKE = "awake"
    OFFLOADED = "offloaded"  # weights copied to host memory (CUDA, level 1)
    DISCARDED = "discarded"  # contents dropped: the KV cache, or the model at level 2


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct storage once (views and tied tensors share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage._cdata, storage)  # the C++ storage: one per allocation, whatever wraps it
    return list(seen.values())


class ReleasedStorages:
    """Storages shrunk to zero bytes, with their sizes and (for an offload) host copies."""

    def __init__(self, storages: list[torch.UntypedStorage], offload: bool) -> None:
        self.storages = storages
        self.sizes = [s.nbytes() for s in storages]
        self.host_copies: list[torch.UntypedStorage] | None = None
        if offload:
            pin = torch.cuda.is_available()
            self.host_copies = []
            for storage in storages:
                host = torch.UntypedStorage(storage.nbytes(), device="cpu")
                if pin and storage.device.type == "cuda":
                    host = host.pin_memory()
                host.copy_(storage)
                self.host_copies.append(host)
        for storage in storages:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def restore(self) -> None:
        """Re-allocate every storage at its size: the host copy's contents, or zeros."""
        for i, (storage, size) in enumerate(zip(self.storages, self.sizes)):
            storage.resize_(size)
            if self.host_copies is not None:
                storage.copy_(self.host_copies[i])
            else:
                torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
        self.host_copies = None


def collect_garbage() -> None:
    """Collect a dropped model: its modules and parameters form reference cycles (a
    parameter's weight_loader is bound to its layer). A WorkerProc freezes everything
    it built at start-up out of the collector's reach (gc.freeze), the model included,
    so unfreeze first, collect, and freeze what is left again."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
