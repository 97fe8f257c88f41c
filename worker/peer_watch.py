"""The other TP ranks on this host, watched: the Worker's health check asks whether each
still runs (`Worker.check_health`), in a few µs, without a collective. Used on every
rank; `local_peer_pids` is a collective itself (an object all-gather at start-up, every
rank together)."""

from __future__ import annotations

import os
import select
from typing import Any

import torch

from distributed.shm_utils import host_id


def local_peer_pids(rank: int, world_size: int) -> dict[int, int]:
    """{rank: pid} of the other ranks on this host (one object all-gather, at start-up)."""
    if world_size == 1:
        return {}
    mine = (host_id(), os.getpid())
    everyone: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(everyone, mine)
    return {r: pid for r, (host, pid) in enumerate(everyone) if r != rank and host == mine[0]}


class PeerWatch:
    """Tells, in a few µs, whether a process still runs: a pidfd (Linux >= 5.3) becomes
    readable when its process exits, zombie or not; elsewhere, signal 0."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._poll: select.poll | None = None
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def alive(self) -> bool:
        if self._poll is not None:
            return not self._poll.poll(0)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self) -> None:
        if self._poll is not None:
            self._poll = None
            os.close(self._fd)
