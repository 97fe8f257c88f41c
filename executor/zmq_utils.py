"""Small ZeroMQ helpers for :mod:`executor.message_queue`.

Everything here runs in whichever process owns the socket; ZeroMQ sockets are
not thread-safe, so each socket must only be used by one thread at a time.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable

import zmq

Socket = zmq.Socket[bytes]

#: Upper bound on one blocking poll, so flags kept outside ZeroMQ (shared
#: memory, ``threading.Event``) are re-checked at least this often.
POLL_TICK_MS = 100

#: Unix-domain socket paths are limited to ~108 bytes (incl. NUL) on Linux.
_MAX_IPC_PATH = 100

#: Prefix of the identification topic every reader subscribes to, so the
#: writer's XPUB socket can tell *which* readers are connected.
READY_TOPIC = b"\x00tpmq-reader-"


def ipc_address(ipc_dir: str, name: str) -> str:
    """Return ``ipc://<ipc_dir>/<name>``; raises ValueError if the path is too long."""
    path = os.path.join(ipc_dir, name)
    if len(path.encode()) > _MAX_IPC_PATH:
        raise ValueError(f"IPC socket path too long ({len(path)} > {_MAX_IPC_PATH}): {path!r}")
    return "ipc://" + path


def make_xpub(address: str, *, sndhwm: int) -> Socket:
    """Bind an XPUB socket (the writer side). ``sndhwm=0`` means never drop."""
    sock: Socket = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    # Report every subscription, not just the first per topic: harmless for
    # the per-reader topics and required if two readers ever share one.
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    sock.bind(address)
    if address.startswith("ipc://"):
        # Owner-only whatever the umask (the directory is 0700 too): peers unpickle what
        # comes through here.
        os.chmod(address[len("ipc://"):], 0o600)
    return sock


def make_sub(address: str, *, rank: int, rcvhwm: int) -> Socket:
    """Connect a SUB socket (a reader) that receives everything and announces ``rank``.

    ``connect`` is asynchronous, so this works before the writer has bound.
    """
    sock: Socket = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.SUBSCRIBE, READY_TOPIC + str(rank).encode())
    sock.connect(address)
    return sock


def drain(sock: Socket) -> list[bytes]:
    """Receive every message already queued on ``sock`` without blocking."""
    out: list[bytes] = []
    while True:
        try:
            out.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return out


def poll_ms(deadline: float | None) -> int:
    """Milliseconds for the next poll tick; raises TimeoutError once ``deadline`` passed."""
    if deadline is None:
        return POLL_TICK_MS
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("message queue operation timed out")
    return max(1, min(POLL_TICK_MS, math.ceil(remaining * 1000)))


def subscribed_ranks(messages: Iterable[bytes]) -> set[int]:
    """Reader ranks announced by XPUB subscription messages (``b"\\x01" + topic``)."""
    ranks: set[int] = set()
    prefix = b"\x01" + READY_TOPIC
    for msg in messages:
        if msg.startswith(prefix):
            ranks.add(int(msg[len(prefix):]))
    return ranks
