"""Shared pieces of the reliability suite (tests/reliability/): fault hooks that run
inside the workers, and checks that an engine left nothing of ours behind.

Workers import this module when a function defined here is sent to them by reference
(collective_rpc), so nothing here starts an engine or touches global state at import.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from tests import runtime_helpers

# How long a test waits for a worker to reach a fault point (start-up is ~1-3 s here).
REACH_S = 120.0


# ---------------------------------------------------------------- fault hooks (run in a worker)


def arm_forward_fault(worker: Any, rank: int, action: str, at_forward: int = 1, marker: str | None = None,
                      seconds: float = 0.0) -> bool:
    """Install a forward pre-hook on the last decoder layer of `rank`'s model, so the
    fault strikes mid-forward, after the first layers' all-reduces: on its
    `at_forward`-th forward (the profile run counts if it comes later) it writes its pid
    to `marker` (if given), then "raise"s, "hang"s (sleeps for good), SIGKILLs its own
    process ("sigkill") or keeps the CPU "busy" for `seconds` (a slow step that is not
    hung). Returns whether it armed."""
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
        if action == "sigkill":  # dies mid-forward, at a known step
            os.kill(os.getpid(), signal.SIGKILL)
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


def short_tmpdir() -> Path:
    """A new empty directory with a short path, for use as an engine's TMPDIR (a unix
    socket path must stay under ~100 bytes, and pytest's tmp_path is long)."""
    return Path(tempfile.mkdtemp(prefix="tpt-", dir="/tmp"))


def engine_dirs() -> set[str]:
    """The engines' private directories (tp-*) that exist now, wherever they are made:
    in multiprocessing's temp dir of this process (forkserver) or the temp directory."""
    from multiprocessing import util

    found = set()
    for parent in {util.get_temp_dir(), tempfile.gettempdir()}:
        try:
            found |= {os.path.join(parent, n) for n in os.listdir(parent) if n.startswith("tp-")}
        except FileNotFoundError:
            pass
    return found


def queue_sockets(creator_pid: int | None = None) -> dict[str, int]:
    """{name: flags} of the unix sockets of the message queues that `creator_pid`
    (default: this process) named, from /proc/net/unix: files (a path) or abstract
    names (starting with '@'); flags has 0x10000 set for a listening socket."""
    pid = os.getpid() if creator_pid is None else creator_pid
    tag = f"tpmq_{pid}_"
    out = {}
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and tag in parts[7]:
                out[parts[7]] = int(parts[3], 16)
    return out


def sockets_left(creator_pid: int | None = None, timeout: float = 5.0) -> dict[str, int]:
    """`queue_sockets(creator_pid)` once it is empty, or what is still there after
    `timeout`: ZeroMQ closes a closed socket's descriptor on its reaper thread a moment
    later, and the kernel drops the socket only with its last descriptor."""
    deadline = time.monotonic() + timeout
    while (left := queue_sockets(creator_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def assert_nothing_left(pids: Iterable[int], ipc_dir: str | None, shm_before: set[str],
                        creator_pid: int | None = None, tmpdir: Path | None = None) -> None:
    """runtime_helpers' checks (workers dead, private directory gone, no new segment),
    plus: no socket of `creator_pid`'s queues; `tmpdir` (the engine's TMPDIR, if given) empty."""
    runtime_helpers.assert_nothing_left(pids, ipc_dir, shm_before, creator_pid)
    left = sockets_left(creator_pid)
    assert not left, f"sockets left: {sorted(left)}"
    if tmpdir is not None:
        left = sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*"))
        assert not left, f"left in the temp directory {tmpdir}: {left}"
