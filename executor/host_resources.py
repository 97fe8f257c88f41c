"""What one multiprocess worker group takes from its host, checked before anything starts.

Used by MultiprocExecutor at start-up, on the engine's thread:

- the process start method (`get_mp_context`): forkserver with torch and the worker stack
  loaded (set TP_WORKER_MULTIPROC_METHOD=spawn to change), so a rank forks from a warm
  interpreter; where it is safe, the forkserver is a fork of the engine process, made
  before the store or the queues start a thread (executor/forked_forkserver.py), else the
  stock one importing `FORKSERVER_PRELOAD`;
- a private 0700 directory for the queues' socket files (`private_dir`: never abstract
  names, those have no permissions), inside this process's multiprocessing temp
  directory (`pymp-*`, 0700, where the forkserver's own socket lives). Shutdown removes
  it; when the engine dies instead, the forkserver (which outlives it for a moment,
  SIGTERM or not) removes the whole `pymp-*` directory on its way out, and the workers
  remove the private one (spawn method), so a SIGKILLed engine leaves nothing on disk;
- the torch.distributed rendezvous (`loopback_store`): a TCPStore this process serves
  on 127.0.0.1 only, on a port the kernel picks, so no store file exists and no port is
  raced for;
- room in /dev/shm for every segment of the group (`check_shm_space`: ShmSpaceError
  names the directory and the bytes), and a writable temp directory (TempDirError
  naming it);
- whether the engine may spin for replies, or would take the cycles from a rank on its
  core (`engine_may_spin`).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from multiprocessing import util as mp_util
from typing import Any

from executor.errors import ShmSpaceError, TempDirError
from executor.shm_ring import RingLayout, RingSpec
from worker.cpu_affinity import allowed_cpus, spare_cpus

__all__ = ["FORKSERVER_PRELOAD", "MQ_CHUNKS", "MQ_CHUNK_BYTES", "check_shm_space", "get_mp_context",
           "loopback_store", "private_dir", "shm_bytes_needed", "shm_dir"]

FORKSERVER_PRELOAD = ["torch", "executor.worker_proc"]
# Queue geometry (MessageQueueOwner's defaults), also used to size /dev/shm's needs.
MQ_CHUNK_BYTES = 4 * 1024 * 1024
MQ_CHUNKS = 8


def get_mp_context() -> multiprocessing.context.BaseContext:
    """The context TP_WORKER_MULTIPROC_METHOD names (forkserver by default, preloading
    FORKSERVER_PRELOAD); ValueError naming the allowed methods for any other value."""
    method = os.environ.get("TP_WORKER_MULTIPROC_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"TP_WORKER_MULTIPROC_METHOD={method!r} is not valid; allowed: 'forkserver', 'spawn'")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def private_dir(method: str) -> str:
    """A fresh 0700 directory for one engine's socket files. Under the forkserver it is
    made inside multiprocessing's temp dir of this process (pymp-*), which the forkserver
    removes when this process dies (executor/worker_proc.py); otherwise in the temp
    directory. Raises TempDirError naming the directory (and TMPDIR) if it cannot."""
    env = os.environ.get("TMPDIR")
    if env and not (os.path.isdir(env) and os.access(env, os.W_OK | os.X_OK)):
        # Python would quietly fall back to /tmp; a TMPDIR that is set means a choice.
        raise TempDirError(f"TMPDIR={env!r} is not a writable directory: the engine keeps its sockets in a "
                           "private directory there; point TMPDIR at a writable directory (or unset it)")
    try:
        parent = mp_util.get_temp_dir() if method == "forkserver" else tempfile.gettempdir()
        return tempfile.mkdtemp(prefix="tp-", dir=parent)
    except OSError as e:
        raise TempDirError(f"cannot create the engine's private directory in {tempfile.gettempdir()!r} "
                           f"(TMPDIR={env!r}): {e}; point TMPDIR at a writable directory") from None


def loopback_store() -> Any:
    """The rendezvous TCPStore, listening on 127.0.0.1 only: torch's own server binds
    every interface, so we hand it a socket bound here (a port the kernel picks).
    Dropping the store closes its listening socket."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the fd now
    return store


def shm_dir() -> str:
    """Where POSIX shared memory lives (glibc: /dev/shm); TP_SHM_DIR names another
    mount for the start-up space check."""
    return os.environ.get("TP_SHM_DIR", "/dev/shm")


def shm_bytes_needed(config: Any, world_size: int) -> dict[str, int]:
    """Bytes of shared memory one worker group maps, by user."""
    ring = RingLayout.of(RingSpec("size", world_size, MQ_CHUNK_BYTES, MQ_CHUNKS)).total
    reply = RingLayout.of(RingSpec("size", 1, MQ_CHUNK_BYTES, MQ_CHUNKS)).total
    needs = {"message queues": ring + world_size * reply}
    if config.device_config.device_type == "cpu" and os.environ.get("TP_CPU_SHM_ALLREDUCE", "1") != "0":
        from distributed.device_communicators.shm_allreduce import DEFAULT_SLOT_BYTES

        needs["CPU all-reduce"] = world_size * 2 * DEFAULT_SLOT_BYTES + 2 * world_size * 64
    return needs


def check_shm_space(config: Any, world_size: int) -> None:
    """Raise ShmSpaceError unless the shared-memory directory can hold the group's
    segments. (tmpfs accepts a segment larger than its free space and the writer gets
    SIGBUS later, at the first touch of a missing page: so look first.)"""
    path = shm_dir()
    try:
        st = os.statvfs(path)
    except OSError as e:
        raise ShmSpaceError(f"cannot check the shared-memory directory {path} (TP_SHM_DIR): {e}") from None
    free = st.f_bavail * st.f_frsize
    needs = shm_bytes_needed(config, world_size)
    needed = sum(needs.values())
    if free < needed:
        parts = ", ".join(f"{k} {v}" for k, v in needs.items())
        raise ShmSpaceError(
            f"{path} has {free} bytes free, but tensor_parallel_size={world_size} needs {needed} bytes of shared "
            f"memory there ({parts}): free some space in {path} (in Docker: --shm-size), or set "
            "TP_CPU_SHM_ALLREDUCE=0 to keep the CPU all-reduce out of it"
        )


def engine_may_spin(config: Any, world_size: int) -> bool:
    """Whether the engine's process may busy-wait for its ranks' replies: not on a CPU
    host whose cores all run ranks (cpu_threads_bind "auto" uses every core, "none" lets
    each rank use them all), where a spin, while the ranks run a step of tens of ms,
    only takes time from the rank on the same core. A core left to no rank, or a GPU
    device, keeps the short spin that saves a wake-up per call."""
    device = config.device_config
    if device.device_type != "cpu":
        return True
    return bool(spare_cpus(device.cpu_threads_bind, world_size, allowed_cpus()))
