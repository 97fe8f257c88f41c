"""Shared-memory broadcast queue: one writer, ``n_reader`` readers, any processes.

Roles and lifecycle (each role is a separate ``MessageQueue`` object)::

    creator = MessageQueue(n_reader)             # executor: owns shm name + ipc dir
    handle = creator.export_handle()             # picklable, send to children
    w = MessageQueue.attach(handle, writer=True)            # exactly one process
    r = MessageQueue.attach(handle, reader_rank=i)          # one per rank 0..n-1
    w.wait_until_ready()     # all readers subscribed (enqueue also does this lazily)
    creator.unlink()         # once everyone attached: nothing can leak any more
    w.enqueue(obj); r.dequeue()
    w.shutdown(); r.shutdown(); creator.shutdown()

Messages are pickled (protocol 5) into a ring of ``max_chunks`` chunks. Each
chunk has a ``written`` byte, one ``read`` byte per reader, a payload length and
a kind. A pickle larger than ``max_chunk_bytes`` is sent over a ZeroMQ PUB
socket instead and its chunk only carries an overflow marker, so there is no
size cap. Readers spin briefly, then sleep on a ZeroMQ notify socket that the
writer only pokes when some reader has announced (in shared memory) that it is
asleep; every blocking poll is bounded to 100 ms and re-checks the ring, so a
missed wake-up costs latency, never liveness.

POSIX only (shm_open + ipc:// sockets).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import pickle
import shutil
import struct
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Literal, NamedTuple

import _posixshmem  # POSIX-only stdlib module behind SharedMemory
import zmq

from executor import zmq_utils

__all__ = ["MessageQueue", "MessageQueueHandle", "QueueClosedError"]


class QueueClosedError(RuntimeError):
    """Raised by enqueue/dequeue after ``shutdown()`` on this object, or by a
    reader once the writer shut down and every message before that was read."""


_SPIN_S = 5e-4  # busy-wait budget before a reader sleeps on the notify socket
_WRITER_MAX_SLEEP_S = 1e-3  # cap of the writer's backoff while the ring is full
_SHUTDOWN_JOIN_S = 2.0  # how long shutdown() waits for a blocked call to bail out
_SHUTDOWN_FLUSH_S = 1.0  # how long a writer's shutdown() waits for overflow delivery
# Wake-ups are tiny, but a small high-water mark made libzmq drop some even when the
# reader had drained its queue (measured: ~6% of hand-offs then waited a full poll tick).
_NOTIFY_HWM = 1000
_ALIGN = 64
_INLINE, _OVERFLOW = 0, 1
_META = struct.Struct("<QB")  # payload length, kind
_CLOSED_OFF = 0  # global header byte set by the writer's shutdown()

_fence_lock = threading.Lock()


def _fence() -> None:
    # CPython has no atomic_thread_fence; a mutex acquire/release runs atomic
    # read-modify-write instructions with acquire/release semantics (lock
    # cmpxchg on x86, ldaxr/stlxr on ARM), which orders our plain shm stores
    # and loads in practice. Same trick as vLLM's shm_broadcast.
    with _fence_lock:
        pass


# sched_yield lets the process we wait for run on an oversubscribed box;
# macOS lacks it, where sleep(0) is the closest stand-in.
_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class MessageQueueHandle:
    """Everything a process needs to attach; picklable (sent to spawned workers)."""

    shm_name: str
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    data_addr: str  # writer XPUB for overflow payloads
    notify_addr: str  # writer XPUB for wake-ups


class _Layout(NamedTuple):
    """Byte offsets: header [writer_closed][asleep x n][reader_gone x n], then
    chunks of [written][read x n][pad to 8][length u64, kind u8][pad][payload]."""

    header: int
    meta: int  # relative to the chunk start, like payload
    payload: int
    stride: int
    total: int

    @classmethod
    def of(cls, h: MessageQueueHandle) -> _Layout:
        header = _align(1 + 2 * h.n_reader)
        meta = (1 + h.n_reader + 7) // 8 * 8
        payload = _align(meta + _META.size)
        stride = _align(payload + h.max_chunk_bytes)
        return cls(header, meta, payload, stride, header + stride * h.max_chunks)


def _map_segment(handle: MessageQueueHandle, fd: int | None) -> mmap.mmap:
    size = _Layout.of(handle).total
    if fd is not None:
        return mmap.mmap(fd, size)
    # Deliberately not SharedMemory(name): before 3.13 it registers the name
    # with the resource tracker, and spawn/forkserver children share the creator's
    # tracker, whose registry is a *set* -- a child's register is a no-op and
    # its unregister would cancel the creator's registration (losing the
    # SIGKILL safety net and making the creator's own unlink print a KeyError).
    fd = _posixshmem.shm_open("/" + handle.shm_name, os.O_RDWR, mode=0o600)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"shm segment {handle.shm_name!r} is smaller than its handle says")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class MessageQueue:
    """One-writer / N-reader broadcast queue over shared memory.

    Each object has one role: ``creator`` (built by ``__init__``), ``writer`` or
    ``reader`` (built by ``attach``). Calling a method of another role raises
    RuntimeError. One thread at a time may use a writer/reader object, except
    ``shutdown()``, which may be called from any thread.
    """

    # Creators alive in this process, so attach() here still works after unlink().
    _creators: weakref.WeakValueDictionary[str, MessageQueue] = weakref.WeakValueDictionary()
    # Set by attach() only (the creator has no sockets and never touches the ring).
    _lay: _Layout
    _data: zmq_utils.Socket  # overflow payloads
    _notify: zmq_utils.Socket  # wake-ups

    def __init__(
        self,
        n_reader: int,
        *,
        max_chunk_bytes: int = 4 * 1024 * 1024,
        max_chunks: int = 8,
        ipc_dir: str | None = None,
    ) -> None:
        """Create the ring (creator role); runs in the process that owns the queue's lifetime.

        The creator keeps the segment registered with the resource tracker so
        it is removed even if this process is SIGKILLed before ``unlink()``.
        ``ipc_dir=None`` makes a private 0700 temp dir that ``shutdown()``
        removes; a caller-provided dir is kept (only our socket files go).
        """
        if n_reader < 1 or max_chunk_bytes < 1 or max_chunks < 1:
            raise ValueError("n_reader, max_chunk_bytes and max_chunks must all be >= 1")
        self._init_state("creator")
        self._own_ipc_dir = ipc_dir is None
        self._ipc_dir = tempfile.mkdtemp(prefix="tp-mq-") if ipc_dir is None else ipc_dir
        name = f"tpmq_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        try:
            self._handle = MessageQueueHandle(
                shm_name=name,
                n_reader=n_reader,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                data_addr=zmq_utils.ipc_address(self._ipc_dir, name + ".data"),
                notify_addr=zmq_utils.ipc_address(self._ipc_dir, name + ".notify"),
            )
            # Fresh POSIX shm is zero-filled: no chunk written, nobody asleep.
            self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
                name=name, create=True, size=_Layout.of(self._handle).total
            )
        except BaseException:
            if self._own_ipc_dir:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            raise
        MessageQueue._creators[name] = self

    def _init_state(self, role: Literal["creator", "writer", "reader"]) -> None:
        self._role = role
        self._rank = -1
        self._shm = None
        self._mm: mmap.mmap | None = None
        self._buf: memoryview | None = None
        self._sockets: list[zmq_utils.Socket] = []
        self._wake_r = self._wake_w = -1
        self._closed = threading.Event()
        self._op_lock = threading.RLock()  # held by enqueue/dequeue; shutdown joins on it
        self._state_lock = threading.Lock()
        self._shutdown_started = self._unlinked = self._ready = self._sent_overflow = False
        self._idx = 0

    @classmethod
    def attach(
        cls, handle: MessageQueueHandle, *, writer: bool = False, reader_rank: int | None = None
    ) -> MessageQueue:
        """Become the single writer (``writer=True``) or reader ``reader_rank``; any process.

        A reader subscribes here, which is its half of the readiness handshake.
        The writer binds its sockets here and must call ``wait_until_ready()``
        (or just ``enqueue``). Raises FileNotFoundError if the creator already
        unlinked the segment (except in the creator's own process), ValueError
        on a bad role.
        """
        if writer == (reader_rank is not None):
            raise ValueError("pass exactly one of writer=True or reader_rank=<int>")
        if reader_rank is not None and not 0 <= reader_rank < handle.n_reader:
            raise ValueError(f"reader_rank {reader_rank} not in [0, {handle.n_reader})")
        self = cls.__new__(cls)
        self._init_state("writer" if writer else "reader")
        self._handle, self._lay = handle, _Layout.of(handle)
        creator = cls._creators.get(handle.shm_name)
        shm = creator._shm if creator is not None else None
        fd: int | None = shm._fd if shm is not None else None  # type: ignore[attr-defined]
        try:
            self._mm = _map_segment(handle, fd)
            self._buf = memoryview(self._mm)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            if writer:
                self._data = zmq_utils.make_xpub(handle.data_addr, sndhwm=0)
                self._sockets.append(self._data)
                self._notify = zmq_utils.make_xpub(handle.notify_addr, sndhwm=_NOTIFY_HWM)
                self._sockets.append(self._notify)
            else:
                assert reader_rank is not None
                self._rank = reader_rank
                self._data = zmq_utils.make_sub(handle.data_addr, rank=reader_rank, rcvhwm=0)
                self._sockets.append(self._data)
                self._notify = zmq_utils.make_sub(
                    handle.notify_addr, rank=reader_rank, rcvhwm=_NOTIFY_HWM
                )
                self._sockets.append(self._notify)
        except BaseException:
            self._release()
            raise
        return self

    def export_handle(self) -> MessageQueueHandle:
        """The picklable handle (any role)."""
        return self._handle

    @property
    def closed(self) -> bool:
        """True once ``shutdown()`` ran on this object."""
        return self._closed.is_set()

    # ----------------------------------------------------------------- writer

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer only: block until all ``n_reader`` readers are subscribed to both sockets.

        Until then an overflow payload or wake-up could be dropped by PUB/SUB.
        Raises TimeoutError, or QueueClosedError if shut down meanwhile.
        """
        self._require("writer")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._op_lock, self._translate_closed():
            if self._ready:
                return
            missing = {s: set(range(self._handle.n_reader)) for s in self._sockets}
            poller = zmq.Poller()
            for sock in self._sockets:
                poller.register(sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            while True:
                for sock in self._sockets:
                    missing[sock] -= zmq_utils.subscribed_ranks(zmq_utils.drain(sock))
                if not any(missing.values()):
                    break
                self._check_open()
                try:
                    self._poll(poller, deadline)
                except TimeoutError:
                    ranks = sorted(set().union(*missing.values()))
                    raise TimeoutError(f"readers {ranks} never subscribed") from None
            self._ready = True

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Writer only: pickle ``obj`` and publish it to every reader.

        Blocks while the ring is full (the slowest reader is ``max_chunks``
        behind) and, on first use, until all readers are ready. Raises
        TimeoutError if that lasts past ``timeout`` seconds (nothing was
        sent); QueueClosedError after ``shutdown()`` or if the ring is full
        and some reader has called ``shutdown()`` (a SIGKILLed reader is not
        detected: use a timeout); and whatever pickling raises.
        """
        self._require("writer")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._op_lock, self._translate_closed():
            self._check_open()
            if not self._ready:
                self.wait_until_ready(None if deadline is None else max(0.0, deadline - time.monotonic()))
            payload = pickle.dumps(obj, protocol=5)
            h, lay, buf = self._handle, self._lay, self._buf
            assert buf is not None
            off = self._wait_writable(deadline)
            buf[off] = 0
            if len(payload) > h.max_chunk_bytes:
                # Sent before the marker is published, so a reader that sees
                # the marker only waits for bytes already in flight.
                self._data.send(payload, copy=False)
                _META.pack_into(buf, off + lay.meta, len(payload), _OVERFLOW)
                self._sent_overflow = True
            else:
                _META.pack_into(buf, off + lay.meta, len(payload), _INLINE)
                start = off + lay.payload
                buf[start : start + len(payload)] = payload
            _fence()  # payload must be visible before any flag says "readable"
            buf[off + 1 : off + 1 + h.n_reader] = bytes(h.n_reader)
            _fence()
            buf[off] = 1
            self._idx = (self._idx + 1) % h.max_chunks
            _fence()  # store->load: publish `written` before looking at sleep flags
            if buf[1 : 1 + h.n_reader] != bytes(h.n_reader):
                try:
                    self._notify.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the subscriber already has wake-ups queued

    def _chunk_free(self, off: int) -> bool:
        buf, n = self._buf, self._handle.n_reader
        assert buf is not None
        return buf[off] == 0 or buf[off + 1 : off + 1 + n] == b"\x01" * n

    def _wait_writable(self, deadline: float | None) -> int:
        off = self._lay.header + self._idx * self._lay.stride
        buf, n = self._buf, self._handle.n_reader
        assert buf is not None
        spin_end = time.monotonic() + _SPIN_S
        delay = 0.0
        while not self._chunk_free(off):
            self._check_open()
            gone = buf[1 + n : 1 + 2 * n]  # a reader that shut down will never catch up
            if any(gone):
                raise QueueClosedError(f"reader(s) {[r for r in range(n) if gone[r]]} shut down")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError("ring stayed full: a reader is not keeping up")
            if now < spin_end:
                _yield_cpu()
            else:
                # No wake-up channel from readers to the writer; a capped
                # backoff keeps a writer stuck behind a slow reader cheap.
                delay = min(max(delay * 2, 2e-5), _WRITER_MAX_SLEEP_S)
                time.sleep(delay)
        _fence()  # readers' payload loads complete before we overwrite the chunk
        return off

    def _ring_drained(self) -> bool:
        lay = self._lay
        return all(self._chunk_free(lay.header + i * lay.stride) for i in range(self._handle.max_chunks))

    # ----------------------------------------------------------------- reader

    def dequeue(self, timeout: float | None = None) -> Any:
        """Reader only: return the next message, in the writer's order.

        Raises TimeoutError if none arrives within ``timeout`` seconds (safe to
        retry: nothing is consumed), QueueClosedError after ``shutdown()`` on
        this object (also from another thread, within ~100 ms) or once the
        writer shut down and everything it sent was read. An exception from
        unpickling propagates, and that message counts as consumed.
        """
        self._require("reader")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._op_lock, self._translate_closed():
            self._check_open()
            lay, buf = self._lay, self._buf
            assert buf is not None
            off = self._wait_readable(deadline)
            length, kind = _META.unpack_from(buf, off + lay.meta)
            frame = self._recv_overflow(deadline) if kind == _OVERFLOW else None
            try:
                if frame is not None:
                    return pickle.loads(frame.buffer)
                start = off + lay.payload
                with buf[start : start + length] as view:
                    return pickle.loads(view)
            finally:
                _fence()  # our payload loads complete before the writer may reuse it
                buf[off + 1 + self._rank] = 1
                self._idx = (self._idx + 1) % self._handle.max_chunks

    def _wait_readable(self, deadline: float | None) -> int:
        buf = self._buf
        assert buf is not None
        off = self._lay.header + self._idx * self._lay.stride
        flag, asleep = off + 1 + self._rank, 1 + self._rank
        spin_end = min(time.monotonic() + _SPIN_S, math.inf if deadline is None else deadline)
        while not (buf[off] == 1 and buf[flag] == 0):
            self._check_open()
            if time.monotonic() >= spin_end:
                break
            _yield_cpu()
        else:
            _fence()
            return off
        poller = zmq.Poller()
        poller.register(self._notify, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        buf[asleep] = 1
        try:
            while True:
                _fence()  # store->load: announce sleep before re-checking the flag
                if buf[off] == 1 and buf[flag] == 0:
                    _fence()
                    return off
                if buf[_CLOSED_OFF]:
                    _fence()  # the flag may be seen before the chunk's final store
                    if buf[off] == 1 and buf[flag] == 0:
                        continue
                    raise QueueClosedError("writer shut down and the queue is drained")
                if self._notify in self._poll(poller, deadline):
                    zmq_utils.drain(self._notify)
        finally:
            buf[asleep] = 0

    def _recv_overflow(self, deadline: float | None) -> zmq.Frame:
        assert self._buf is not None
        poller = zmq.Poller()
        poller.register(self._data, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        writer_closed_ticks = 0
        while True:
            try:
                frame: zmq.Frame = self._data.recv(zmq.NOBLOCK, copy=False)
                return frame
            except zmq.Again:
                pass
            if self._buf[_CLOSED_OFF]:
                # The writer gave up flushing (we were too slow); allow one
                # more tick for bytes in flight, then declare the message lost.
                writer_closed_ticks += 1
                if writer_closed_ticks > 2:
                    raise QueueClosedError("writer shut down before an overflow payload arrived")
            self._poll(poller, deadline)

    # --------------------------------------------------------------- shared

    def _require(self, role: str) -> None:
        if self._role != role:
            raise RuntimeError(f"this MessageQueue is the {self._role}, not the {role}")

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise QueueClosedError("message queue was shut down")

    def _poll(self, poller: zmq.Poller, deadline: float | None) -> dict[Any, int]:
        events = dict(poller.poll(zmq_utils.poll_ms(deadline)))
        if self._wake_r in events:
            raise QueueClosedError("message queue was shut down")
        self._check_open()
        return events

    @contextlib.contextmanager
    def _translate_closed(self) -> Iterator[None]:
        # shutdown() from this same thread (signal handler) or after a join
        # timeout closes sockets/maps under a running call; report that as
        # what it is rather than as a raw ZMQError/ValueError.
        try:
            yield
        except (zmq.ZMQError, ValueError) as exc:
            if self._closed.is_set():
                raise QueueClosedError("message queue was shut down") from exc
            raise

    # ------------------------------------------------------------- teardown

    def unlink(self) -> None:
        """Creator only, idempotent: remove the shm name; existing mappings stay valid.

        Call as soon as every process has attached: afterwards no SIGKILL of
        anyone can leak a /dev/shm segment. Later ``attach`` calls fail, except
        in this process while this creator is alive.
        """
        self._require("creator")
        with self._state_lock:
            if self._unlinked or self._shm is None:
                return
            self._unlinked = True
        try:
            self._shm.unlink()  # also unregisters from the resource tracker
        except FileNotFoundError:
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Any role, any thread, idempotent: release this object's resources.

        Makes a call blocked in another thread raise QueueClosedError. A writer
        first waits up to 1 s for readers to consume pending overflow payloads,
        then marks the queue closed so readers raise QueueClosedError once
        drained. A reader marks itself gone, so a writer blocked on the full
        ring raises instead of hanging. The creator also unlinks the segment
        and removes its socket files / private ipc dir.
        """
        with self._state_lock:
            if self._shutdown_started:
                return
            self._shutdown_started = True
        self._closed.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"\0")
            except OSError:
                pass
        # RLock: a same-thread re-entry (e.g. from a signal handler) proceeds
        # at once and the interrupted call sees its sockets vanish. If another
        # thread does not bail out in time, its sockets/fds/mapping are left
        # to the GC rather than closed (and their numbers reused) under it.
        acquired = self._op_lock.acquire(timeout=_SHUTDOWN_JOIN_S)
        try:
            if not acquired:
                return
            if self._role == "writer" and self._buf is not None:
                flush_end = time.monotonic() + _SHUTDOWN_FLUSH_S
                while self._sent_overflow and not self._ring_drained() and time.monotonic() < flush_end:
                    time.sleep(1e-3)
                self._buf[_CLOSED_OFF] = 1
                _fence()
                try:
                    self._notify.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # readers notice the flag on their next poll tick anyway
            if self._role == "reader" and self._buf is not None:
                self._buf[1 + self._handle.n_reader + self._rank] = 1
            if self._role == "creator":
                self.unlink()
                MessageQueue._creators.pop(self._handle.shm_name, None)
            self._release()
        finally:
            if acquired:
                self._op_lock.release()

    def close(self) -> None:
        """Alias of ``shutdown()``."""
        self.shutdown()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _release(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a stray view still exists; the mapping goes with it
            self._mm = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
            self._remove_ipc_files()

    def _remove_ipc_files(self) -> None:
        if self._own_ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            return
        for suffix in (".data", ".notify"):
            try:
                os.unlink(os.path.join(self._ipc_dir, self._handle.shm_name + suffix))
            except FileNotFoundError:
                pass
