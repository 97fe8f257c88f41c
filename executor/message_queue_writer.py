"""The single writer of a message queue (see :mod:`executor.message_queue`)."""

from __future__ import annotations

import os
import time
from typing import Any

import zmq

from executor import zmq_utils
from executor.message_queue import MessageQueueHandle, QueueClosedError, QueueEndpoint
from executor.serial_utils import encode_message
from executor.shm_ring import ShmRing, yield_cpu

__all__ = ["MessageQueueWriter"]

_WRITER_MAX_SLEEP_S = 1e-3  # cap of the writer's backoff while the ring is full
_SHUTDOWN_FLUSH_S = 1.0  # how long shutdown() waits for overflow delivery


class MessageQueueWriter(QueueEndpoint):
    """Publishes every message to all ``n_reader`` readers, in order.

    Exactly one per queue, in any process. Binds its XPUB socket (overflow payloads)
    and opens every reader's wake-up FIFO here; call ``wait_until_ready()`` (or just
    ``enqueue``) before relying on delivery. Holds the ring's mapping, and each
    overflow payload until ZeroMQ has passed it on.
    """

    def __init__(self, handle: MessageQueueHandle) -> None:
        self._ready = False
        self._sent_overflow = False
        super().__init__(handle)

    def _connect(self) -> None:
        self._data = self._own(zmq_utils.make_xpub(self._handle.data_addr, sndhwm=0))
        self._wake_fds = [self._open_fifo(path) for path in self._handle.wake_paths]

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until all ``n_reader`` readers are subscribed to the overflow socket.

        Until then an overflow payload could be dropped by PUB/SUB (a wake-up cannot
        be: it waits in the reader's FIFO).
        Raises TimeoutError naming the missing ranks, or QueueClosedError if shut
        down meanwhile.
        """
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
        """Encode ``obj`` once (``executor.serial_utils``) and publish it to every reader.

        Blocks while the ring is full (the slowest reader is ``max_chunks``
        behind) and, on first use, until all readers are ready. Raises
        TimeoutError if that lasts past ``timeout`` seconds (nothing was
        sent); QueueClosedError after ``shutdown()`` or if the ring is full
        and some reader has called ``shutdown()`` (a SIGKILLed reader is not
        detected: use a timeout); and whatever encoding raises (nothing was sent).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._op_lock, self._translate_closed():
            self._check_open()
            if not self._ready:
                self.wait_until_ready(None if deadline is None else max(0.0, deadline - time.monotonic()))
            payload = encode_message(obj)
            ring = self._ring
            assert ring is not None
            self._wait_writable(ring, deadline)
            overflow = len(payload) > self._handle.max_chunk_bytes
            if overflow:
                # Sent before the marker is published, so a reader that sees
                # the marker only waits for bytes already in flight.
                self._data.send(payload, copy=False)
                self._sent_overflow = True
            ring.write_chunk(self._idx, payload, overflow=overflow)
            self._idx = (self._idx + 1) % self._handle.max_chunks
            for rank in ring.asleep_readers():
                self._wake(rank)

    def _wake(self, rank: int) -> None:
        try:
            os.write(self._wake_fds[rank], b"\0")
        except BlockingIOError:
            pass  # the FIFO is full of wake-ups the reader has yet to drain: it will wake

    def _wait_writable(self, ring: ShmRing, deadline: float | None) -> None:
        spin_end = self._spin_end(None)
        delay = 0.0
        while not ring.chunk_free(self._idx):
            self._check_open()
            gone = ring.gone_readers()  # a reader that shut down will never catch up
            if gone:
                raise QueueClosedError(f"reader(s) {gone} shut down")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError("ring stayed full: a reader is not keeping up")
            if now < spin_end:
                yield_cpu()
            else:
                # No wake-up channel from readers to the writer; a capped
                # backoff keeps a writer stuck behind a slow reader cheap.
                delay = min(max(delay * 2, 2e-5), _WRITER_MAX_SLEEP_S)
                time.sleep(delay)

    def _on_shutdown(self, ring: ShmRing) -> None:
        flush_end = time.monotonic() + _SHUTDOWN_FLUSH_S
        while self._sent_overflow and not ring.all_chunks_free() and time.monotonic() < flush_end:
            time.sleep(1e-3)
        ring.mark_writer_closed()
        for rank in range(self._handle.n_reader):
            try:
                self._wake(rank)
            except OSError:
                pass  # readers notice the flag on their next poll tick anyway
