"""Start real `torchrun` (`python -m torch.distributed.run`) processes for the tests, on
loopback only, and make sure nothing they started outlives a test.

Every address is 127.0.0.1: the static rendezvous (`--master-addr`), the c10d one
(`--rdzv-endpoint`, `--local-addr`), gloo (`GLOO_SOCKET_IFNAME=lo`) and the HTTP server.
Each torchrun gets a private TMPDIR, so the test can check what was left in it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import REPO, free_port
from tests.runtime_helpers import pid_alive

# torchrun's own log directory (torchelastic_*) is created in TMPDIR and never removed;
# it is torchrun's, not ours.
TORCHRUN_OWN_TMP_PREFIX = "torchelastic_"
SHM_PREFIXES = ("tpmq_", "tp-allreduce-")


def loopback_env(tmpdir: Path) -> dict[str, str]:
    tmpdir.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}


def single_node_args(nproc: int, master_port: int) -> list[str]:
    return ["--nnodes", "1", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(master_port)]


def two_node_args(node_rank: int, rdzv_port: int, run_id: str) -> list[str]:
    """One torchrun of a two-node job, nodes on this host: c10d rendezvous on loopback,
    node 0 hosting the store."""
    return ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={1 if node_rank == 0 else 0}", "--local-addr", "127.0.0.1"]


class Torchrun:
    """One torchrun process (output to `log_path`) and the ranks it started."""

    def __init__(self, launcher_args: list[str], target: list[str], log_path: Path, tmpdir: Path) -> None:
        self.cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args, *target]
        self.log_path = log_path
        self.tmpdir = tmpdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: dict[int, psutil.Process] = {}  # every descendant ever seen, by pid

    def start(self) -> Torchrun:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=loopback_env(self.tmpdir), stdout=log,
                                         stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ranks(self) -> dict[int, psutil.Process]:
        """The live rank processes, by their RANK: the agent's own children (their
        children, such as multiprocessing's resource tracker, inherit RANK too)."""
        out = {}
        try:
            agent = psutil.Process(self.pid)
            children, descendants = agent.children(), agent.children(recursive=True)
        except psutil.NoSuchProcess:
            return out
        for proc in descendants:
            self.seen[proc.pid] = proc
        for child in children:
            try:
                rank = child.environ().get("RANK")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if rank is not None:
                out[int(rank)] = child
        return out

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def leftovers(self) -> list[int]:
        """Pids of every process this torchrun started that is still alive."""
        self.ranks()
        return [pid for pid in self.seen if pid_alive(pid)]

    def kill_all(self) -> None:
        """Safety net at teardown: SIGKILL the agent and everything it started."""
        self.ranks()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        for proc in self.seen.values():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def our_shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES)}
    except FileNotFoundError:
        return set()


def ours_left_in(tmpdir: Path) -> list[str]:
    """What is left in a torchrun's private TMPDIR besides torchrun's own log dir."""
    if not tmpdir.exists():
        return []
    return sorted(n for n in os.listdir(tmpdir) if not n.startswith(TORCHRUN_OWN_TMP_PREFIX))


def new_run_id() -> str:
    return f"tp-test-{uuid.uuid4().hex[:12]}"


def listening_ports(proc: psutil.Process) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket `proc` listens on."""
    conns: list[Any] = proc.net_connections(kind="tcp")
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


__all__ = ["Torchrun", "free_port", "listening_ports", "loopback_env", "new_run_id", "our_shm_segments",
           "ours_left_in", "single_node_args", "two_node_args", "wait_gone"]
