"""Shared-memory broadcast queue: one writer, ``n_reader`` readers, any processes.

Three roles, one class each::

    owner = MessageQueueOwner(n_reader)        # executor: owns shm name + ipc dir
    handle = owner.export_handle()             # picklable, send to children
    w = MessageQueueWriter(handle)             # exactly one process
    r = MessageQueueReader(handle, rank)       # one per rank 0..n_reader-1
    w.wait_until_ready()     # all readers subscribed (enqueue also does this lazily)
    owner.unlink()           # once everyone attached: nothing can leak any more
    w.enqueue(obj); r.dequeue()
    w.shutdown(); r.shutdown(); owner.shutdown()

The writer encodes each message once (:mod:`executor.serial_utils`: MessagePack for
the RPC envelope and the step messages, a pickle for anything else) into the ring of
:mod:`executor.shm_ring`, and each reader decodes it once. A message larger than
``max_chunk_bytes`` is sent over a ZeroMQ PUB socket instead and its chunk only
carries an overflow marker, so there is no size cap. Readers
spin briefly, then sleep in poll() on their own FIFO (named pipe), to which the
writer writes one byte only when that reader has announced (in shared memory)
that it is asleep; every blocking poll is bounded to 100 ms and re-checks the
ring, so a missed wake-up costs latency, never liveness.

Why a FIFO and not a ZeroMQ socket: a wake-up is on the critical path of every
step (a rank's reply wakes the engine), and it comes after tens of ms of model
code that evicted every cache. A ZeroMQ send then cost the sender 140-150 µs (its
code, then a hand-off to its I/O thread, which also ran on the sender's core) and
the receiver one more thread hop; a FIFO write is one system call (22 µs cold,
the read included) and wakes the sleeping reader directly. Both ends open the
FIFO read-write, so neither open blocks or depends on the other's order, and a
wake-up sent before the reader attached simply waits in the pipe.

This module holds what the roles share: the handle, the error, the tunables and
the writer's and reader's common base (:class:`QueueEndpoint`). The writer is in
:mod:`executor.message_queue_writer`, the reader in
:mod:`executor.message_queue_reader`. POSIX only (shm_open, ipc:// sockets, mkfifo).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from executor import zmq_utils
from executor.shm_ring import RingSpec, ShmRing, ShmSegment

__all__ = ["MessageQueueHandle", "MessageQueueOwner", "QueueClosedError", "QueueEndpoint"]

# Tunables, read at call time (scripts/bench_rpc.py patches _SPIN_S in every process).
_SPIN_S = 5e-4  # busy-wait budget before a reader sleeps / a writer on a full ring backs off
_SHUTDOWN_JOIN_S = 2.0  # how long shutdown() waits for a blocked call to bail out


class QueueClosedError(RuntimeError):
    """Raised by enqueue/dequeue after ``shutdown()`` on this object, or by a
    reader once the writer shut down and every message before that was read."""


@dataclass(frozen=True)
class MessageQueueHandle(RingSpec):
    """Everything a process needs to attach; picklable (sent to spawned workers)."""

    data_addr: str  # writer XPUB for overflow payloads
    wake_paths: tuple[str, ...]  # reader r's FIFO for wake-ups is wake_paths[r]


class MessageQueueOwner:
    """Creates a queue's segment, socket name and wake-up FIFOs (one per reader, 0600),
    and removes them; never sends or reads.

    Lives in the process that owns the queue's lifetime (the executor). ``ipc_dir=None``
    makes a private 0700 temp dir that ``shutdown()`` removes; a caller-provided dir is
    kept (only our socket and FIFO files go). Names are unique per call (pid + random).
    Raises ValueError on a bad geometry or a too-long socket path, OSError where the
    FIFOs cannot be made.
    """

    def __init__(
        self,
        n_reader: int,
        *,
        max_chunk_bytes: int = 4 * 1024 * 1024,
        max_chunks: int = 8,
        ipc_dir: str | None = None,
    ) -> None:
        self._own_ipc_dir = ipc_dir is None
        self._ipc_dir = tempfile.mkdtemp(prefix="tp-mq-") if ipc_dir is None else ipc_dir
        self._lock = threading.Lock()
        self._shut_down = False
        name = f"tpmq_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        segment: ShmSegment | None = None
        made: list[str] = []
        try:
            self._handle = MessageQueueHandle(
                shm_name=name,
                n_reader=n_reader,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                data_addr=zmq_utils.ipc_address(self._ipc_dir, name + ".data"),
                wake_paths=tuple(os.path.join(self._ipc_dir, f"{name}.wake{r}") for r in range(n_reader)),
            )
            segment = ShmSegment(self._handle)
            for path in self._handle.wake_paths:
                os.mkfifo(path, 0o600)
                made.append(path)
        except BaseException:
            if segment is not None:
                segment.close()
            for path in made:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if self._own_ipc_dir:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            raise
        self._segment = segment

    def export_handle(self) -> MessageQueueHandle:
        """The picklable handle to pass to ``MessageQueueWriter`` / ``MessageQueueReader``."""
        return self._handle

    def unlink(self) -> None:
        """Idempotent, any thread: remove the shm name (see ``ShmSegment.unlink``)."""
        self._segment.unlink()

    def shutdown(self) -> None:
        """Idempotent, any thread: unlink, then remove the socket and FIFO files / private ipc dir.

        Endpoints attached in any process keep working until their own shutdown."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        self._segment.close()
        if self._own_ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            return
        for path in (self._handle.data_addr.removeprefix("ipc://"), *self._handle.wake_paths):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> MessageQueueOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class QueueEndpoint:
    """What the writer and a reader share: the mapped ring, the overflow socket, the
    wake-up FIFOs they opened, and a shutdown that any thread may call to cancel a
    blocked call.

    One thread at a time may use an endpoint, except ``shutdown()``. Subclasses open
    their socket and FIFOs in ``_connect`` and mark the ring in ``_on_shutdown``. Construction
    raises FileNotFoundError if the owner already unlinked the segment (except in
    the owner's own process).
    """

    _data: zmq_utils.Socket  # overflow payloads

    def __init__(self, handle: MessageQueueHandle) -> None:
        self._handle = handle
        self._ring: ShmRing | None = None
        self._sockets: list[zmq_utils.Socket] = []
        self._fifos: list[int] = []
        self._wake_r = self._wake_w = -1
        self._closed = threading.Event()
        self._op_lock = threading.RLock()  # held by enqueue/dequeue; shutdown joins on it
        self._state_lock = threading.Lock()
        self._shutdown_started = False
        self._idx = 0  # this endpoint's next chunk
        try:
            self._ring = ShmRing.attach(handle)
            # A pipe, not just the Event: it wakes a poll() that another thread is in.
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._connect()
        except BaseException:
            self._release()
            raise

    def _connect(self) -> None:
        raise NotImplementedError

    def _on_shutdown(self, ring: ShmRing) -> None:
        raise NotImplementedError

    def _own(self, sock: zmq_utils.Socket) -> zmq_utils.Socket:
        self._sockets.append(sock)
        return sock

    def _open_fifo(self, path: str) -> int:
        """A wake-up FIFO, opened read-write and non-blocking: the open never waits for
        the other end, and a full pipe (wake-ups nobody read yet) refuses a write
        instead of blocking it, which loses nothing since one pending byte wakes."""
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._fifos.append(fd)
        return fd

    def _spin_end(self, deadline: float | None, spin_s: float | None = None) -> float:
        spin = _SPIN_S if spin_s is None else spin_s
        return min(time.monotonic() + spin, math.inf if deadline is None else deadline)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise QueueClosedError("message queue was shut down")

    def _poll(self, poller: zmq.Poller | select.poll, deadline: float | None) -> dict[Any, int]:
        """One bounded poll tick; ``poller`` must include ``self._wake_r``."""
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

    def shutdown(self) -> None:
        """Any thread, idempotent: release this endpoint's sockets, pipe and mapping.

        A call blocked in another thread raises QueueClosedError (within ~100 ms).
        The writer first waits up to 1 s for readers to consume pending overflow
        payloads, then marks the queue closed so readers raise QueueClosedError
        once drained. A reader marks itself gone, so a writer blocked on the full
        ring raises instead of hanging.
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
            if self._ring is not None:
                self._on_shutdown(self._ring)
            self._release()
        finally:
            if acquired:
                self._op_lock.release()

    def _release(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        for fd in self._fifos:
            os.close(fd)
        self._fifos.clear()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._ring is not None:
            self._ring.close()
            self._ring = None
