"""Helpers for the end-to-end engine runtime tests (test_engine_runtime.py,
test_engine_failures.py): engine configs sized for tests, and checks that an engine
left nothing behind (worker processes, /dev/shm segments, IPC socket files, fds, threads).

Nothing here starts an engine at import time: worker processes may import this module
when a test function defined here is sent to them by reference.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import psutil

# Small enough to be quick, large enough for one max_model_len sequence at every TP size
# used here (the tiny llama needs 8 blocks of <= 8 KiB at max_model_len=128).
KV_BYTES = 256 * 1024
MAX_MODEL_LEN = 128
# Liveness bounds (not performance): how long a dead process may take to be noticed.
DEATH_BOUND_S = 10.0


def engine_config(model: str | os.PathLike, tp: int = 1, **overrides: Any):
    """A resolved EngineConfig for a tiny checkpoint on CPU/gloo with a small, fixed KV budget."""
    from engine.arg_utils import create_engine_config

    kwargs: dict[str, Any] = dict(
        model=str(model),
        tensor_parallel_size=tp,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=KV_BYTES,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_MODEL_LEN,
        use_tqdm_on_load=False,
    )
    kwargs.update(overrides)
    return create_engine_config(**kwargs)


def shm_segments(creator_pid: int | None = None) -> set[str]:
    """Names of the message-queue segments in /dev/shm created by `creator_pid`
    (default: this process). Other test runs on the machine have their own pids."""
    pid = os.getpid() if creator_pid is None else creator_pid
    prefix = f"tpmq_{pid}_"
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:  # no /dev/shm: nothing can leak there
        return set()


def pid_alive(pid: int) -> bool:
    """True if `pid` is a live process (a zombie is dead: it only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def wait_pids_gone(pids: Iterable[int], timeout: float = DEATH_BOUND_S) -> list[int]:
    """Poll until every pid is dead or `timeout` passes; returns the ones still alive."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _is_mp_helper(proc: psutil.Process) -> bool:
    """The multiprocessing forkserver / resource tracker of this interpreter: shared by
    every engine by design, started once. They are direct children of this process (the
    forkserver's own children, the workers, share its command line, so ppid tells them apart).
    A forkserver forked from this process (executor/forked_forkserver.py) has this
    process's command line, so it is known by the pid multiprocessing keeps for it."""
    from multiprocessing import forkserver

    if proc.pid == forkserver._forkserver._forkserver_pid:  # type: ignore[attr-defined]
        return True
    try:
        if proc.ppid() != os.getpid():
            return False
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False
    return "forkserver" in cmd or "resource_tracker" in cmd


def live_children() -> set[int]:
    """Pids of this process's live descendants, minus the multiprocessing helpers."""
    out = set()
    for child in psutil.Process().children(recursive=True):
        if not _is_mp_helper(child) and pid_alive(child.pid):
            out.add(child.pid)
    return out


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled_thread_count(baseline: int, timeout: float = 5.0) -> int:
    """threading.active_count(), after giving daemon threads of a finished engine (the
    worker monitor) up to `timeout` to return to `baseline`."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    return threading.active_count()


def worker_pids(core: Any) -> list[int]:
    """Worker process ids of an EngineCore with the multiprocess executor."""
    return [p.pid for p in core.model_executor.processes]


def assert_nothing_left(pids: Iterable[int], ipc_dir: str | None, shm_before: set[str],
                        creator_pid: int | None = None) -> None:
    """After an engine is gone: its workers are dead, its IPC dir (sockets, FileStore) is
    removed, and no new segment of `creator_pid` is in /dev/shm."""
    pids = list(pids)
    alive = wait_pids_gone(pids)
    assert not alive, f"worker processes still alive: {alive} (of {pids})"
    if ipc_dir is not None:
        assert not Path(ipc_dir).exists(), f"IPC dir {ipc_dir} left behind: {os.listdir(ipc_dir)}"
    leaked = shm_segments(creator_pid) - shm_before
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"


# ---------------------------------------------------------------- RPC bodies
# Module-level so cloudpickle sends them by reference; workers import this module.


def kv_layout(worker: Any) -> dict[str, Any]:
    """This rank's KV cache config and tensor shapes."""
    runner = worker.model_runner
    return {
        "rank": worker.rank,
        "pid": os.getpid(),
        "num_blocks": runner.kv_cache_config.num_blocks,
        "num_kv_heads_per_rank": runner.kv_cache_config.num_kv_heads_per_rank,
        "shapes": [tuple(t.shape) for t in runner.kv_caches],
        "dtypes": [str(t.dtype) for t in runner.kv_caches],
    }


def fail_on_rank_1_while_rank_0_waits(worker: Any) -> str:
    """RPC body: rank 1 raises, so rank 0 waits in a collective that can never complete."""
    import torch.distributed as dist

    if worker.rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
    return "unreachable"
