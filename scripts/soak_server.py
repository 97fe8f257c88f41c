"""The server side of scripts/soak.py: its own `python -m engine.serve` (start, log, stop)
and the RSS of a server's process tree.

Imported by bare name from soak.py and soak_load.py (scripts/ is not a package); not a
script of its own: `python scripts/soak.py --help` says how to run the soak.

`OwnServer` is used from soak.py's main thread only. Its server is started with
bench_common's `die_with_parent`, so that a soak killed outright (SIGKILL, a harness's
timeout) takes its server with it: Linux sends the server SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from bench_common import REPO, die_with_parent, free_port

MiB = 1 << 20


def _process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and every descendant (workers, forkserver); [] once `pid` is gone."""
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> int:
    """RSS of `pid` and every descendant (workers, forkserver), in bytes."""
    total = 0
    for p in _process_tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def rss_by_process(pid: int) -> dict[str, float]:
    """{"pid name": RSS MiB} of `pid` and its descendants: which process grew."""
    out: dict[str, float] = {}
    for p in _process_tree(pid):
        try:
            out[f"{p.pid} {p.name()}"] = round(p.memory_info().rss / MiB, 1)
        except psutil.NoSuchProcess:
            pass
    return out


def pid_listening_on(port: int) -> int | None:
    """The pid of the process listening on TCP `port` here (None if none is found or
    the OS does not say): a `--url` server's pid, for its RSS."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except psutil.AccessDenied:
        return None
    return None


class OwnServer:
    """`python -m engine.serve` on a tiny checkpoint, on a free loopback port."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "server.log"
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Write the checkpoint (unless --model), start the server and wait until /health
        answers 200. Raises RuntimeError, with the log's tail, if it does not start."""
        model = self.args.model
        if model is None:
            from engine.tiny_model import make_tiny_model

            model = make_tiny_model(self.workdir / "tiny", "llama", hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=512, max_position_embeddings=512, seed=11, init_std=0.1,
                                    with_tokenizer=True)
        for _ in range(3):  # the free port can be taken between picking and binding
            self.port = free_port()
            cmd = [sys.executable, "-m", "engine.serve", str(model), "--tp", str(self.args.tp), "--device", "cpu",
                   "--dtype", "float32", "--kv-cache-memory", self.args.kv_cache_memory, "--max-model-len",
                   str(self.args.max_model_len), "--served-model-name", "soak", "--no-access-log",
                   "--disable-log-stats", "--port", str(self.port), *self.args.server_arg]
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                             preexec_fn=die_with_parent)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if "address already in use" not in self.log().lower():
                break
        raise RuntimeError(f"the server did not start; log:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> tuple[int | None, list[int]]:
        """SIGTERM; (exit code, pids of descendants still alive 15 s after it exited)."""
        if self.proc is None:
            return None, []
        children = psutil.Process(self.proc.pid).children(recursive=True) if self.proc.poll() is None else []
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        _, alive = psutil.wait_procs(children, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return code, [p.pid for p in alive]


if __name__ == "__main__":
    print(__doc__)
