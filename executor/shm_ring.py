"""The shared-memory ring under the message queue: its bytes, its flags, and their order.

Layout (``RingLayout``)::

    header: [writer_closed][asleep x n_reader][reader_gone x n_reader]   pad to 64
    chunk i (max_chunks of them, stride a multiple of 64):
            [written][read x n_reader] pad to 8 [length u64][kind u8] pad to 64 [payload]

Protocol (one writer, ``n_reader`` readers; each side keeps its own chunk index and
advances it by one, mod ``max_chunks``, per message)::

    writer, chunk i:    wait chunk_free(i): written == 0 or every read == 1      fence
                        written = 0; length, kind, payload                       fence
                        read[*] = 0                                              fence
                        written = 1                                              fence
                        asleep_readers()? -> the queue wakes each of them
    reader r, chunk i:  wait readable(i, r): written == 1 and read[r] == 0       fence
                        load length, kind, payload                               fence
                        read[r] = 1
    reader r sleeping:  asleep[r] = 1                                            fence
                        re-check readable(i, r) before (and after) every sleep

The last two fences of each side are store->load: either the writer sees
``asleep[r]`` and wakes the reader, or the reader sees ``written == 1`` and never
sleeps, so no wake-up is lost for good. ``writer_closed`` is set by the writer's
shutdown after its last chunk; ``reader_gone[r]`` by reader r's shutdown, so a writer
waiting on a full ring can stop instead of hanging.

No ZeroMQ and no threads here: blocking, waking and overflow payloads belong to
:mod:`executor.message_queue`. POSIX only (shm_open).
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

from distributed.shm_utils import attach_shm, memory_fence

__all__ = ["RingLayout", "RingSpec", "ShmRing", "ShmSegment", "fence", "yield_cpu"]

_ALIGN = 64
_META = struct.Struct("<QB")  # payload length, kind
_INLINE, _OVERFLOW = 0, 1
_CLOSED_OFF = 0

fence = memory_fence


# sched_yield lets the process we wait for run on an oversubscribed box;
# macOS lacks it, where sleep(0) is the closest stand-in.
yield_cpu: Callable[[], None] = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class RingSpec:
    """Name and geometry of one ring; identical in every process that maps it (picklable)."""

    shm_name: str
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int


class RingLayout(NamedTuple):
    """Byte offsets of a ring with a given ``RingSpec`` (see the module docstring)."""

    header: int
    meta: int  # relative to the chunk start, like payload
    payload: int
    stride: int
    total: int

    @classmethod
    def of(cls, spec: RingSpec) -> RingLayout:
        header = _align(1 + 2 * spec.n_reader)
        meta = (1 + spec.n_reader + 7) // 8 * 8
        payload = _align(meta + _META.size)
        stride = _align(payload + spec.max_chunk_bytes)
        return cls(header, meta, payload, stride, header + stride * spec.max_chunks)


class ShmSegment:
    """The creator's ownership of one ring's POSIX shm name.

    Built once, in the process that owns the queue's lifetime. The name stays
    registered with the resource tracker, so the segment is removed even if this
    process is SIGKILLed before ``unlink()``. While this object is alive,
    ``ShmRing.attach`` in this same process works even after ``unlink()``.
    Raises ValueError on a bad geometry, OSError if the segment cannot be created.
    """

    # Owners alive in this process, by shm name, so attach() here survives unlink().
    _owned: weakref.WeakValueDictionary[str, ShmSegment] = weakref.WeakValueDictionary()

    def __init__(self, spec: RingSpec) -> None:
        if spec.n_reader < 1 or spec.max_chunk_bytes < 1 or spec.max_chunks < 1:
            raise ValueError("n_reader, max_chunk_bytes and max_chunks must all be >= 1")
        self.spec = spec
        self._lock = threading.Lock()
        self._unlinked = False
        # Fresh POSIX shm is zero-filled: no chunk written, nobody asleep or gone.
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=spec.shm_name, create=True, size=RingLayout.of(spec).total
        )
        ShmSegment._owned[spec.shm_name] = self

    def unlink(self) -> None:
        """Idempotent, any thread: remove the shm name; existing mappings stay valid.

        Call once every process has attached: afterwards no SIGKILL of anyone can
        leak a /dev/shm entry. Later ``attach`` calls fail with FileNotFoundError,
        except in this process while this object is alive.
        """
        with self._lock:
            if self._unlinked or self._shm is None:
                return
            self._unlinked = True
        try:
            self._shm.unlink()  # also unregisters from the resource tracker
        except FileNotFoundError:
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]

    def close(self) -> None:
        """Idempotent: unlink, then drop this process's handle on the segment."""
        self.unlink()
        ShmSegment._owned.pop(self.spec.shm_name, None)
        with self._lock:
            shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()

    @classmethod
    def _fd_in_this_process(cls, name: str) -> int | None:
        owner = cls._owned.get(name)
        shm = owner._shm if owner is not None else None
        return shm._fd if shm is not None else None  # type: ignore[attr-defined]


class ShmRing:
    """One process's mapping of a ring, with the flag protocol as methods.

    Writer-side methods may only be called by the single writer, reader-side ones
    only by reader ``rank``; the ring does not check which process you are. Chunk
    indices are the caller's. Holds one mapping of ``RingLayout.of(spec).total``
    bytes until ``close()``.
    """

    def __init__(self, spec: RingSpec, mm: mmap.mmap) -> None:
        self.spec = spec
        self.layout = RingLayout.of(spec)
        self._mm: mmap.mmap | None = mm
        self._buf = memoryview(mm)

    @classmethod
    def attach(cls, spec: RingSpec) -> ShmRing:
        """Map an existing segment. Raises FileNotFoundError once it was unlinked (except
        in its owner's process), ValueError if it is smaller than ``spec`` says."""
        size = RingLayout.of(spec).total
        fd = ShmSegment._fd_in_this_process(spec.shm_name)
        if fd is not None:
            return cls(spec, mmap.mmap(fd, size))
        return cls(spec, attach_shm(spec.shm_name, size))

    def close(self) -> None:
        """Idempotent: unmap. Any later protocol call raises ValueError."""
        self._buf.release()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a payload view; the mapping goes with it
            self._mm = None

    def _chunk(self, idx: int) -> int:
        return self.layout.header + idx * self.layout.stride

    # ----------------------------------------------------------------- writer

    def _free(self, off: int) -> bool:
        buf, n = self._buf, self.spec.n_reader
        return buf[off] == 0 or buf[off + 1 : off + 1 + n] == b"\x01" * n

    def chunk_free(self, idx: int) -> bool:
        """Writer: may chunk ``idx`` be overwritten (never written, or read by everyone)?"""
        if not self._free(self._chunk(idx)):
            return False
        fence()  # readers' payload loads complete before we overwrite the chunk
        return True

    def write_chunk(self, idx: int, payload: bytes | bytearray, *, overflow: bool) -> None:
        """Writer, after ``chunk_free(idx)``: publish ``payload`` in chunk ``idx``.

        ``overflow=True`` stores only the length (the bytes travel elsewhere, and must
        already be on their way); otherwise ``len(payload) <= max_chunk_bytes``.
        """
        buf, lay, n = self._buf, self.layout, self.spec.n_reader
        off = self._chunk(idx)
        buf[off] = 0
        _META.pack_into(buf, off + lay.meta, len(payload), _OVERFLOW if overflow else _INLINE)
        if not overflow:
            start = off + lay.payload
            buf[start : start + len(payload)] = payload
        fence()  # payload must be visible before any flag says "readable"
        buf[off + 1 : off + 1 + n] = bytes(n)
        fence()
        buf[off] = 1
        fence()  # store->load: publish `written` before asleep_readers() looks

    def asleep_readers(self) -> list[int]:
        """Writer, right after ``write_chunk``: the ranks that announced they sleep."""
        n = self.spec.n_reader
        flags = self._buf[1 : 1 + n]
        if flags == bytes(n):
            return []
        return [r for r in range(n) if flags[r]]

    def gone_readers(self) -> list[int]:
        """Ranks whose reader shut down (they will never free a chunk again)."""
        n = self.spec.n_reader
        gone = self._buf[1 + n : 1 + 2 * n]
        return [r for r in range(n) if gone[r]]

    def all_chunks_free(self) -> bool:
        """Writer: has every reader read every chunk written so far?"""
        return all(self._free(self._chunk(i)) for i in range(self.spec.max_chunks))

    def mark_writer_closed(self) -> None:
        """Writer's shutdown, after its last ``write_chunk``."""
        self._buf[_CLOSED_OFF] = 1
        fence()

    # ----------------------------------------------------------------- reader

    def readable(self, idx: int, rank: int) -> bool:
        """Reader ``rank``: is chunk ``idx`` written and not yet read by us?"""
        off = self._chunk(idx)
        if not (self._buf[off] == 1 and self._buf[off + 1 + rank] == 0):
            return False
        fence()  # the flags before the payload they guard
        return True

    def chunk_meta(self, idx: int) -> tuple[int, bool]:
        """Reader, after ``readable``: (payload length, sent as overflow?)."""
        length, kind = _META.unpack_from(self._buf, self._chunk(idx) + self.layout.meta)
        return length, kind == _OVERFLOW

    def payload(self, idx: int, length: int) -> memoryview:
        """Reader, after ``readable``: a view of the inline payload; release it before
        ``mark_read`` (use it as a context manager)."""
        start = self._chunk(idx) + self.layout.payload
        return self._buf[start : start + length]

    def mark_read(self, idx: int, rank: int) -> None:
        """Reader ``rank`` is done with chunk ``idx``; the writer may reuse it."""
        fence()  # our payload loads complete before the writer may reuse it
        self._buf[self._chunk(idx) + 1 + rank] = 1

    def set_asleep(self, rank: int, asleep: bool) -> None:
        """Reader ``rank`` announces it sleeps (re-check ``readable`` afterwards) or woke."""
        self._buf[1 + rank] = 1 if asleep else 0
        if asleep:
            fence()  # store->load: announce sleep before re-checking the flag

    def writer_closed(self) -> bool:
        """Reader: has the writer shut down? Re-check ``readable`` when True: the flag
        may be seen before the last chunk's final store."""
        if not self._buf[_CLOSED_OFF]:
            return False
        fence()
        return True

    def mark_reader_gone(self, rank: int) -> None:
        """Reader ``rank``'s shutdown: a writer blocked on the full ring gives up."""
        self._buf[1 + self.spec.n_reader + rank] = 1
