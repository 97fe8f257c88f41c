"""Shared pieces of the reliability suite (tests/reliability/): fault hooks that run
inside the workers, and checks that an engine left nothing of ours behind.

Workers import this module when a function defined here is sent to them by reference
(collective_rpc), so nothing here starts an engine or touches global state at import.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable

from tests.runtime_helpers import shm_segments, wait_pids_gone

# How long a test waits for a worker to reach a fault point (start-up is ~1-3 s here).
REACH_S = 120.0


# ---------------------------------------------------------------- fault hooks (run in a worker)


def arm_forward_fault(worker: Any, rank: int, action: str, at_forward: int = 1, marker: str | None = None,
                      seconds: float = 0.0) -> bool:
    """Install a forward pre-hook on the last decoder layer of `rank`'s model, so the
    fault strikes mid-forward, after the first layers' all-reduces: on its
    `at_forward`-th forward (the profile run counts if it comes later) it writes its pid
    to `marker` (if given), then "raise"s, "hang"s (sleeps for good) or keeps the CPU
    "busy" for `seconds` (a slow step that is not hung). Returns whether it armed."""
    if worker.rank != rank:
        return False
    layers = worker.model_runner.model.model.layers
    seen = {"n": 0}

    def hook(module: Any, args: Any) -> None:
        seen["n"] += 1
        if seen["n"] != at_forward:
            return
        if marker:
            Path(marker).write_text(str(os.getpid()))
        if action == "raise":
            raise RuntimeError(f"injected fault in forward #{at_forward} on rank {rank}")
        if action == "hang":
            while True:
                time.sleep(3600)
        if action == "busy":
            end = time.monotonic() + seconds
            x = 0
            while time.monotonic() < end:
                x += 1
            return
        raise ValueError(f"unknown action {action!r}")

    layers[len(layers) - 1].register_forward_pre_hook(hook)
    return True


def wait_for_marker(marker: Path, timeout: float = REACH_S) -> int:
    """The pid a fault hook wrote into `marker`, once it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = marker.read_text()
        except FileNotFoundError:
            text = ""
        if text:
            return int(text)
        time.sleep(0.01)
    raise TimeoutError(f"no worker reached the fault point ({marker} not written in {timeout}s)")


# ---------------------------------------------------------------- what an engine may leave


def abstract_sockets(creator_pid: int | None = None) -> set[str]:
    """Abstract-namespace unix sockets of the message queues created by `creator_pid`
    (default: this process), from /proc/net/unix."""
    pid = os.getpid() if creator_pid is None else creator_pid
    prefix = f"@tpmq_{pid}_"
    out = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(prefix):
                out.add(parts[7])
    return out


def socket_files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_socket()]


def assert_nothing_left(pids: Iterable[int], tmpdir: Path | None, shm_before: set[str],
                        creator_pid: int | None = None) -> None:
    """Workers dead; no segment or abstract socket of `creator_pid`; `tmpdir` (the
    engine's TMPDIR) empty: no private dir, socket file, store or pymp-* dir."""
    pids = list(pids)
    alive = wait_pids_gone(pids)
    assert not alive, f"worker processes still alive: {alive} (of {pids})"
    leaked = shm_segments(creator_pid) - shm_before
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"
    deadline = time.monotonic() + 5.0
    while abstract_sockets(creator_pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel drops a name when its last socket closes
    assert not abstract_sockets(creator_pid), f"sockets left: {sorted(abstract_sockets(creator_pid))}"
    if tmpdir is not None:
        left = sorted(str(p.relative_to(tmpdir)) for p in tmpdir.iterdir())
        assert not left, f"left in the temp directory {tmpdir}: {left}"
