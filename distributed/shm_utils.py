"""Shared-memory primitives for processes of one host: which host a process is on, a
memory fence, and attaching to a POSIX segment by name without the resource tracker.

Used by the CPU shared-memory all-reduce (distributed/device_communicators/), by the
executor's message-queue ring (executor/shm_ring.py) and by the Worker's watch on the
peers of its host (worker/worker.py). POSIX only.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading

import _posixshmem  # POSIX-only stdlib module behind SharedMemory

_fence_lock = threading.Lock()


def host_id() -> str:
    """The same string exactly for every process of one host and one boot of it (the
    host name plus the kernel's boot id), so that ranks that all-gather it know which of
    them share this host's memory and process ids. A host without
    /proc/sys/kernel/random/boot_id is named by its host name alone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def memory_fence() -> None:
    """A full memory barrier between this thread's shared-memory stores and loads.

    CPython has no atomic_thread_fence; a mutex acquire/release runs atomic
    read-modify-write instructions with acquire/release semantics (lock cmpxchg on
    x86, ldaxr/stlxr on ARM), which orders plain shm stores and loads in practice.
    Same trick as vLLM's shm_broadcast.
    """
    with _fence_lock:
        pass


def attach_shm(name: str, size: int) -> mmap.mmap:
    """Map `size` bytes of the existing POSIX segment `name` (no leading slash).

    Deliberately not `SharedMemory(name)`: before Python 3.13 it registers the name with
    the resource tracker, and spawn/forkserver children share the creator's tracker,
    whose registry is a *set*: a child's register is a no-op and its unregister would
    cancel the creator's registration (losing the SIGKILL safety net and making the
    creator's own unlink print a KeyError). Raises FileNotFoundError once the name was
    unlinked, ValueError if the segment is smaller than `size`."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"shm segment {name!r} is smaller than {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
