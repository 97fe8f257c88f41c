"""Ray clusters for tests/test_ray_executor.py, on loopback addresses only.

Ray gives a node the host's routable address when asked for 127.0.0.1, but keeps other
loopback addresses, so each node here gets its own 127.0.0.x. A second node joins only
with token authentication off, and two nodes of one host need their own temp dirs and
ports. Every Ray process started here is recorded by pid and must be gone when its
helper stops (what is still alive then is killed, by pid, and reported); every
directory handed to Ray is removed. Processes are held as psutil.Process objects, never
as bare pids: pids wrap around on this host, and a recycled pid must not be waited for,
let alone killed.

- `RAY_TEST_ENV`: token auth off, usage statistics off (nothing is sent off the host),
  Ray's memory monitor off.
- `LocalRay`: `ray.init` of a local instance in this process.
- `RayNode`: one `ray start --block` subprocess (head or joining) with its own temp dir and ports.
- `ray_descendants(pid)`, `processes(pids)`, `assert_gone(procs)`, `outside_loopback_peers(procs)`.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable

import psutil

from tests.runtime_helpers import DEATH_BOUND_S

# Ray's memory monitor kills workers when the host, shared with other jobs here, runs
# short of memory; the tests' actors are small, so it is off.
RAY_TEST_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0"}
OBJECT_STORE_BYTES = 128 << 20
_PORTS_PER_NODE = 48  # 8 fixed ports, then the worker port range
_FIRST_PORT, _LAST_PORT = 20000, 32000  # below Linux's ephemeral range (32768-60999)


def short_temp_dir() -> str:
    """A fresh directory with a short path: Ray puts unix sockets in it (108-byte limit)."""
    return tempfile.mkdtemp(prefix="tr", dir="/tmp")


def ray_descendants(pid: int) -> set[psutil.Process]:
    """The live processes under `pid` that Ray started (servers, raylets, workers)."""
    found = set()
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            name, argv = child.name(), child.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        # Ray's servers by name, its workers by title ("ray::IDLE", "ray::RayWorkerWrapper"),
        # its Python daemons (dashboard, log monitor, agents) by their script in the ray
        # package (not by the whole command line: a forkserver's lists sys.path, ray's included).
        script = next((arg for arg in argv[1:3] if arg.endswith(".py")), "")
        if name in ("gcs_server", "raylet") or " ".join(argv).startswith("ray::") or "/ray/" in script:
            found.add(child)
    return found


def processes(pids: Iterable[int]) -> set[psutil.Process]:
    """psutil handles of the live processes among `pids`, taken now."""
    found = set()
    for pid in pids:
        try:
            found.add(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # is_running: False once recycled
    except psutil.NoSuchProcess:
        return False


def assert_gone(procs: Iterable[psutil.Process], what: str, timeout: float = DEATH_BOUND_S) -> None:
    """Wait for `procs` to die; kill and report any that outlive `timeout`."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = []
    for proc in procs:
        if _alive(proc):
            try:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]!r}")
                proc.kill()  # psutil refuses if the pid was recycled meanwhile
            except psutil.Error:
                pass
    assert not alive, f"{what}: processes still alive after {timeout:.0f}s: {alive}"


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def outside_loopback_peers(procs: Iterable[psutil.Process]) -> list[tuple[int, str]]:
    """(pid, remote address) of every connection of `procs` to a non-loopback address."""
    peers = []
    for proc in procs:
        try:
            connections = proc.net_connections(kind="inet") if proc.is_running() else []
        except psutil.Error:
            continue
        peers += [(proc.pid, c.raddr.ip) for c in connections if c.raddr and not _is_loopback(c.raddr.ip)]
    return peers


def _free_port_block(ip: str, count: int) -> int:
    """First port of `count` consecutive ports free on `ip` and on every interface."""
    for _ in range(100):
        base = random.randrange(_FIRST_PORT, _LAST_PORT - count)
        try:
            for port in range(base, base + count):
                for host in (ip, "0.0.0.0"):
                    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                        s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no block of {count} free ports between {_FIRST_PORT} and {_LAST_PORT}")


class LocalRay:
    """A local Ray instance started by `ray.init` in this process (node IP `ip`)."""

    def __init__(self, ip: str, num_cpus: int) -> None:
        import ray

        self.temp_dir = short_temp_dir()
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address=ip,
                 _temp_dir=self.temp_dir, object_store_memory=OBJECT_STORE_BYTES)
        self.seen = ray_descendants(os.getpid())

    def record(self) -> None:
        """Note the Ray processes alive now (actors come and go with the engines)."""
        self.seen |= ray_descendants(os.getpid())

    def stop(self) -> None:
        import ray

        self.record()
        ray.shutdown()
        try:
            assert_gone(self.seen, "local Ray instance")
        finally:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


class RayNode:
    """One Ray node, `ray start --block` as our child (its servers, raylet and workers are
    its descendants): the head when `head_address` is None, else joining it."""

    def __init__(self, ip: str, num_cpus: int, head_address: str | None = None) -> None:
        self.ip = ip
        # Ray's temp dir is <RAY_TMPDIR>/ray, where a head records its address
        # (ray_current_cluster): with RAY_TMPDIR=temp_root a process finds this head.
        self.temp_root = short_temp_dir()
        self.temp_dir = os.path.join(self.temp_root, "ray")
        self.log_path = Path(self.temp_root) / "node.log"
        base = _free_port_block(ip, _PORTS_PER_NODE)
        self.address = f"{ip}:{base}" if head_address is None else head_address
        args = [
            "ray", "start", "--block", "--node-ip-address", ip, f"--num-cpus={num_cpus}",
            f"--temp-dir={self.temp_dir}", f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats", "--include-log-monitor=false",
            f"--node-manager-port={base + 1}", f"--object-manager-port={base + 2}",
            f"--dashboard-agent-listen-port={base + 3}", f"--dashboard-agent-grpc-port={base + 4}",
            f"--metrics-export-port={base + 5}", f"--runtime-env-agent-port={base + 6}",
            f"--min-worker-port={base + 8}", f"--max-worker-port={base + _PORTS_PER_NODE - 1}",
        ]
        args += ["--head", f"--port={base}", "--include-dashboard=false"] if head_address is None else \
            [f"--address={head_address}"]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, env={**os.environ, **RAY_TEST_ENV}, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.seen: set[psutil.Process] = processes([self.proc.pid])
        if head_address is None:
            self._wait_for_gcs(base)

    def _wait_for_gcs(self, port: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start --head exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection((self.ip, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the Ray head at {self.ip}:{port} did not come up in {timeout:.0f}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""

    def record(self) -> None:
        self.seen |= ray_descendants(self.proc.pid)

    def kill(self) -> None:
        """Lose the node at once: SIGKILL its whole process tree."""
        self.record()
        for proc in self.seen:
            try:
                proc.kill()
            except psutil.Error:
                pass
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM `ray start --block`, which stops its processes; check they all went."""
        self.record()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        try:
            assert_gone(self.seen, f"Ray node {self.ip}")
        finally:
            shutil.rmtree(self.temp_root, ignore_errors=True)
