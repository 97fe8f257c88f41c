"""Memory accounting for the worker: pool contexts and peak measurement.

A memory pool wraps the allocations of one phase ("weights", "kv_cache"); the platform
picks which (`Platform.memory_pool`). On CUDA it routes them to a dedicated
`torch.cuda.MemPool`, which is what sleep/wake-style offloading builds on; on CPU it is
an accounting context that records how much the process grew. Either way the result is
a `PoolUsage` with the bytes and seconds of the phase.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import psutil
import torch
from torch import nn


def process_rss() -> int:
    return psutil.Process().memory_info().rss


def model_weight_bytes(model: nn.Module) -> int:
    """The bytes `model` holds on this rank: every parameter and buffer once (a tied
    weight once), a weight held in a packed layout at that layout's size
    (`packed_nbytes`: padding, or a float32 copy of a bfloat16 weight), quantised
    tensors (int32-packed values, scales, zero points) at theirs."""
    total = 0
    seen: set[int] = set()
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        packed = getattr(tensor, "packed_nbytes", None)
        total += packed if packed is not None else tensor.numel() * tensor.element_size()
    return total


@dataclass
class PoolUsage:
    tag: str
    bytes_allocated: int = 0
    seconds: float = 0.0
    pool: object | None = field(default=None, repr=False)  # the torch.cuda.MemPool on CUDA


class PeakRSSSampler:
    """Samples this process's RSS on a background thread; `peak` is the maximum seen.

    Used around the profile forward pass on CPU, where torch keeps no peak statistics.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = process_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, process_rss())


@contextlib.contextmanager
def cuda_memory_pool(tag: str) -> Iterator[PoolUsage]:
    """Route every CUDA allocation made inside the block to a dedicated MemPool (what
    sleep-style offloading builds on) and count its bytes."""
    usage = PoolUsage(tag)
    start = time.perf_counter()
    pool = torch.cuda.MemPool()
    usage.pool = pool
    before = torch.cuda.memory_allocated()
    with torch.cuda.use_mem_pool(pool):
        yield usage
    torch.cuda.synchronize()
    usage.bytes_allocated = torch.cuda.memory_allocated() - before
    usage.seconds = time.perf_counter() - start


@contextlib.contextmanager
def cpu_memory_pool(tag: str) -> Iterator[PoolUsage]:
    """An accounting context on the CPU: how much the process grew inside the block."""
    usage = PoolUsage(tag)
    start = time.perf_counter()
    before = process_rss()
    yield usage
    usage.bytes_allocated = max(0, process_rss() - before)
    usage.seconds = time.perf_counter() - start
