"""The 60 s soak (scripts/soak.py) against its own TP=2 server: 100 requests with random
lengths, about a tenth cancelled by the client and a tenth of streams dropped mid-way.
Nothing may be lost, every accepted request finishes (completed or aborted), every KV
block is free at the end, RSS does not grow after warm-up, and the server stops cleanly.
The script's own checks decide; this test also holds it to the figures it reports.
A soak stopped by a signal, or killed, leaves no server of its own running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_soak_60s_nothing_lost_no_growth_kv_free(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", "--requests", "100", "--duration", "60", "--tp", "2", "--seed", "1",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert out.is_file(), f"no report; stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    report = json.loads(out.read_text())
    assert run.returncode == 0, f"{summary}\n{run.stderr}"
    assert summary.startswith("soak: PASS 100 requests"), summary
    server = report["server"]
    assert report["lost"] == 0 and report["failed"] == 0
    assert report["completed"] + report["cut_off"] == 100
    assert report["cancelled"] > 0 and report["disconnected"] > 0, "the run cut nothing off"
    assert server["error"] == 0 and server["rejected"] == 0
    assert server["received"] == server["stop"] + server["length"] + server["abort"]
    assert 0 < server["abort"] <= report["cut_off"]
    assert server["kv_usage_end"] == 0 and server["running_end"] == 0 and server["waiting_end"] == 0
    assert report["rss_warm_mib"] is not None and report["rss_end_mib"] is not None
    assert report["rss_end_mib"] - report["rss_warm_mib"] <= report["rss_tolerance_mib"]
    assert report["server_exit_code"] == 0 and report["leftover_pids"] == []


def _wait_for_own_server(soak: subprocess.Popen, timeout: float = 120) -> list[psutil.Process]:
    """Once the soak's own server answers /health: every process the soak has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if soak.poll() is not None:
            raise AssertionError(f"the soak exited with {soak.returncode} before its server was up:\n"
                                 f"{soak.stderr.read() if soak.stderr else ''}")
        for child in psutil.Process(soak.pid).children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "engine.serve" in cmd and "--port" in cmd:
                url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}/health"
                try:
                    if httpx.get(url, timeout=1).status_code == 200:
                        time.sleep(1)  # the load has started
                        return psutil.Process(soak.pid).children(recursive=True)
                except httpx.TransportError:
                    pass
        time.sleep(0.2)
    raise AssertionError("the soak's server did not come up")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_soak_takes_its_server_down(signum: int) -> None:
    """SIGTERM: the soak stops its server, removes its directory and exits 128 + 15.
    SIGKILL: nothing of it runs on, as Linux sends its server SIGTERM. (TMPDIR is a
    directory of the test's own, short: the server's IPC socket paths live under it.)"""
    tmp = Path(tempfile.mkdtemp(prefix="tps-"))
    soak = subprocess.Popen([sys.executable, "scripts/soak.py", "--requests", "1000", "--duration", "300", "--tp", "2"],
                            cwd=REPO, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    started: list[psutil.Process] = []
    try:
        started = _wait_for_own_server(soak)
        assert any("engine.serve" in " ".join(p.cmdline()) for p in started)
        soak.send_signal(signum)
        _, stderr = soak.communicate(timeout=90)
        _, alive = psutil.wait_procs(started, timeout=60)
        assert alive == [], f"left running: {[p.pid for p in alive]}"
        if signum == signal.SIGTERM:
            assert soak.returncode == 128 + signal.SIGTERM, stderr
            assert "soak: stopped by SIGTERM" in stderr and "processes left" not in stderr, stderr
            assert list(tmp.iterdir()) == [], "the soak's directory was not removed"
        else:
            assert soak.returncode == -signal.SIGKILL
    finally:
        if soak.poll() is None:
            soak.kill()
        for proc in started:
            try:
                proc.kill()
            except psutil.Error:
                pass
        soak.wait()
        shutil.rmtree(tmp, ignore_errors=True)
