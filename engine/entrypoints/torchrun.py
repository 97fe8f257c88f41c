"""`engine.serve` under torchrun (`--distributed-executor-backend external_launcher`):
rank 0 serves HTTP, every other rank follows rank 0's steps and never listens.

    torchrun --nproc-per-node 2 -m engine.serve MODEL --tp 2 --distributed-executor-backend external_launcher

Every rank runs the same command and builds its own EngineCore (the KV block count is
agreed at start-up). Then `take_serving_role` decides: rank 0 leads (each call on its
worker, each step's SchedulerOutput included, is sent to the others first) and the
caller serves; a rank > 0 runs rank 0's calls on its own worker until rank 0 shuts down.

Shutdown: SIGINT/SIGTERM of rank 0 (or torchrun's, which reaches every rank) lets
rank 0 finish in-flight requests for up to --shutdown-timeout, then it tells the
followers to stop and every rank exits 0. A follower that gets a signal keeps
following, since rank 0 is normally draining its requests, and leaves on its own only
if rank 0 has not stopped it `FOLLOWER_GRACE_S` after the shutdown timeout, or at a
second SIGINT. If rank 0 dies, the followers exit 1 at once. Every rank also gets
SIGTERM from Linux if the torchrun agent dies (executor/external_launcher_executor.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from engine.core import EngineCore

logger = logging.getLogger("engine.serve")

FOLLOWER_GRACE_S = 10.0


def uses_external_launcher(core: EngineCore) -> bool:
    return core.config.parallel_config.distributed_executor_backend == "external_launcher"


class _FollowerSignals:
    """SIGINT/SIGTERM on a follower: the first starts the grace period; a second SIGINT
    (Ctrl-C twice) leaves now. Repeated SIGTERMs change nothing: Linux sends one per
    thread of a dying torchrun agent (the parent-death signal follows the rank as it is
    re-parented from thread to thread)."""

    def __init__(self, rank: int, grace_s: float) -> None:
        self.rank = rank
        self.grace_s = grace_s
        self.first_at: float | None = None
        self.interrupts = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.interrupts += signum == signal.SIGINT
        if self.first_at is None:
            self.first_at = time.monotonic()
            logger.info("rank %d: %s received; following rank 0 until it stops (at most %.0fs more)",
                        self.rank, signal.Signals(signum).name, self.grace_s)

    def should_leave(self) -> bool:
        return self.interrupts >= 2 or (self.first_at is not None and time.monotonic() - self.first_at > self.grace_s)


def _exit_now(code: int) -> NoReturn:
    """End a follower whose receiver thread may still be blocked in the control group:
    gloo aborts the process if that group is destroyed under it, so skip the
    interpreter's teardown. Nothing is lost: the kernel closes the sockets, and every
    shared-memory name was unlinked at start-up."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def take_serving_role(core: EngineCore, shutdown_timeout: float) -> int | None:
    """Called by `engine.serve` on every rank once its EngineCore is ready.

    Returns None where this process serves HTTP: any backend but the external launcher,
    or its rank 0, which from now on leads the other ranks. On a rank > 0: follows rank
    0 until it shuts down, shuts this rank's core down and returns 0; exits the process
    with 0 when a signal made it leave first, with 1 when a call failed here; returns 1
    when rank 0 was lost."""
    if not uses_external_launcher(core):
        return None
    from executor.lockstep import LeaderLostError  # torch: not at the CLI's import time

    executor = core.model_executor
    if executor.rank == 0:
        executor.lead()
        return None
    signals = _FollowerSignals(executor.rank, shutdown_timeout + FOLLOWER_GRACE_S)
    try:
        stopped_by_rank0 = executor.follow(signals.should_leave)
    except LeaderLostError as e:  # the receiver thread has ended: a normal shutdown is safe
        logger.error("rank %d stops following: %s", executor.rank, e)
        core.shutdown()
        return 1
    except Exception:  # noqa: BLE001 - this rank no longer matches rank 0
        logger.exception("rank %d stops following: a call from rank 0 failed here", executor.rank)
        _exit_now(1)
    if not stopped_by_rank0:
        logger.info("rank %d: rank 0 did not stop it; leaving on the signal", executor.rank)
        _exit_now(0)
    core.shutdown()
    logger.info("rank %d: rank 0 shut down", executor.rank)
    return 0
