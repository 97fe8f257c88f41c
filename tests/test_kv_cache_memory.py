"""The memory behind a rank's KV cache (worker/kv_cache.py).

On the CPU the cache lives in private anonymous mappings whose pages a background
thread commits: the tensors read as zero from the start, a write made while the commit
runs survives it, the process's RSS holds the whole cache once `wait_committed`
returns, `release` gives it back (and the cache reads as zero again), `restore` takes it
back. `DeviceKVCache` (torch's allocator, here on the CPU) keeps the same contract.
"""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from models.layers.file_pages import trim_heap
from worker.kv_cache import DeviceKVCache, HostKVCache, allocate_kv_cache

pytestmark = pytest.mark.slow

SHAPE = (64, 2, 16, 4, 64)  # 64 blocks of 16 tokens, K and V, 4 heads of 64: 2 MiB per layer in float32
LAYERS = 24
MIB = 1 << 20


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_cpu_caches_are_host_mappings_and_their_tensors_are_bound_once() -> None:
    cache = allocate_kv_cache(SHAPE, torch.float32, LAYERS, torch.device("cpu"))
    assert isinstance(cache, HostKVCache)
    assert cache.nbytes == LAYERS * 2 * MIB
    assert [tuple(t.shape) for t in cache.tensors] == [SHAPE] * LAYERS
    assert len({t.data_ptr() for t in cache.tensors}) == LAYERS
    cache.wait_committed()  # before the mappings go, so that the next test's RSS is its own


@pytest.mark.parametrize("kind", ["host", "device"])
def test_cache_is_zeroed_committed_released_and_restored(kind: str) -> None:
    gc.collect()  # what earlier tests left to free goes now, not while this one measures
    trim_heap()
    before = rss()
    if kind == "host":
        cache = HostKVCache(SHAPE, torch.float32, LAYERS)
    else:
        cache = DeviceKVCache(SHAPE, torch.float32, LAYERS, torch.device("cpu"))
    first, last = cache.tensors[0], cache.tensors[-1]
    first[3].fill_(7.0)  # written while the commit may still run
    cache.wait_committed()
    assert all(float(t.abs().sum()) == (7.0 * first[3].numel() if t is first else 0.0) for t in cache.tensors)
    assert rss() - before >= 0.9 * cache.nbytes, "the cache's pages are not resident"

    resident = rss()
    cache.release()
    trim_heap()  # as the Worker does after a sleep: torch's allocator frees into malloc's heap
    assert not cache.allocated
    released = rss()
    assert resident - released >= 0.9 * cache.nbytes, "release gave nothing back"

    cache.restore()
    cache.wait_committed()
    assert cache.allocated and cache.tensors[0] is first and cache.tensors[-1] is last
    assert float(first.abs().sum()) == 0.0  # what was written before the release is gone
    assert rss() - released >= 0.9 * cache.nbytes, "restore did not commit the cache again"
    last.fill_(1.0)
    assert float(last.sum()) == last.numel()


def test_a_kernel_that_refuses_the_populate_advice_gets_written_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.14 madvise refuses MADV_POPULATE_WRITE (EINVAL); an advice no
    kernel knows gets the same answer here, and the cache then commits itself by
    writing zeros, before the constructor returns."""
    import worker.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "_MADV_POPULATE_WRITE", 0x7FFF)
    gc.collect()
    trim_heap()
    before = rss()
    cache = HostKVCache(SHAPE, torch.float32, LAYERS)
    assert cache._committer is None  # nothing left running
    assert rss() - before >= 0.9 * cache.nbytes
    assert all(float(t.abs().sum()) == 0.0 for t in cache.tensors)
    cache.tensors[0].fill_(2.0)
    cache.release()
    cache.restore()
    assert float(cache.tensors[0].abs().sum()) == 0.0
