"""One reader of a message queue (see :mod:`executor.message_queue`)."""

from __future__ import annotations

import os
import select
import time
from typing import Any

import zmq

from executor import zmq_utils
from executor.message_queue import MessageQueueHandle, QueueClosedError, QueueEndpoint
from executor.serial_utils import decode_message
from executor.shm_ring import ShmRing, yield_cpu

__all__ = ["MessageQueueReader"]


class MessageQueueReader(QueueEndpoint):
    """Reader ``rank`` (``0 <= rank < n_reader``, one object per rank), in any process.

    Subscribes to the writer's overflow socket here, which is its half of the readiness
    handshake (ZeroMQ connects asynchronously, so the writer may bind later), and opens
    its own wake-up FIFO. Every
    reader sees every message. Holds the ring's mapping and at most one overflow
    payload at a time. Raises ValueError on a rank outside the handle's range.

    ``spin_s``: how long a dequeue that finds nothing busy-waits before it sleeps
    (default ``_SPIN_S``); 0 for a reader whose process shares its cores with
    processes that compute (the engine of a CPU executor, waiting on its ranks).
    """

    def __init__(self, handle: MessageQueueHandle, rank: int, spin_s: float | None = None) -> None:
        if not 0 <= rank < handle.n_reader:
            raise ValueError(f"reader_rank {rank} not in [0, {handle.n_reader})")
        self._rank = rank
        self.spin_s = spin_s
        super().__init__(handle)

    def _connect(self) -> None:
        h, rank = self._handle, self._rank
        self._data = self._own(zmq_utils.make_sub(h.data_addr, rank=rank, rcvhwm=0))
        self._wake_fd = self._open_fifo(h.wake_paths[rank])
        self._sleep_poller = select.poll()  # made once: the engine sleeps in it every step
        self._sleep_poller.register(self._wake_fd, select.POLLIN)
        self._sleep_poller.register(self._wake_r, select.POLLIN)

    def dequeue(self, timeout: float | None = None) -> Any:
        """Return the next message, in the writer's order.

        Raises TimeoutError if none arrives within ``timeout`` seconds (safe to
        retry: nothing is consumed), QueueClosedError after ``shutdown()`` on
        this object (also from another thread, within ~100 ms) or once the
        writer shut down and everything it sent was read; MessageDecodeError
        (``executor.serial_utils``) for bytes that are no message, which then count
        as consumed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._op_lock, self._translate_closed():
            self._check_open()
            ring = self._ring
            assert ring is not None
            idx = self._idx
            self._wait_readable(ring, deadline)
            length, overflow = ring.chunk_meta(idx)
            frame = self._recv_overflow(ring, deadline) if overflow else None
            try:
                if frame is not None:
                    return decode_message(frame.buffer)
                with ring.payload(idx, length) as view:
                    return decode_message(view)
            finally:
                ring.mark_read(idx, self._rank)
                self._idx = (idx + 1) % self._handle.max_chunks

    def _wait_readable(self, ring: ShmRing, deadline: float | None) -> None:
        idx, rank = self._idx, self._rank
        spin_end = self._spin_end(deadline, self.spin_s)
        while not ring.readable(idx, rank):
            self._check_open()
            if time.monotonic() >= spin_end:
                break
            yield_cpu()
        else:
            return
        poller = self._sleep_poller
        ring.set_asleep(rank, True)
        try:
            while True:
                if ring.readable(idx, rank):
                    return
                if ring.writer_closed():
                    if ring.readable(idx, rank):
                        return
                    raise QueueClosedError("writer shut down and the queue is drained")
                if self._wake_fd in self._poll(poller, deadline):
                    self._drain_wake_fd()
        finally:
            ring.set_asleep(rank, False)

    def _drain_wake_fd(self) -> None:
        # One read takes every pending wake-up (a writer sends one per message it finds us
        # asleep for); any left over only make a later poll return at once, to re-check.
        try:
            os.read(self._wake_fd, 4096)
        except BlockingIOError:
            pass

    def _recv_overflow(self, ring: ShmRing, deadline: float | None) -> zmq.Frame:
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
            if ring.writer_closed():
                # The writer gave up flushing (we were too slow); allow one
                # more tick for bytes in flight, then declare the message lost.
                writer_closed_ticks += 1
                if writer_closed_ticks > 2:
                    raise QueueClosedError("writer shut down before an overflow payload arrived")
            self._poll(poller, deadline)

    def _on_shutdown(self, ring: ShmRing) -> None:
        ring.mark_reader_gone(self._rank)
