"""scripts/smoke_multi_gpu.sh, the CI smoke job, run for real on CPU: a subprocess, gloo
and shared memory at TP=2, its torchrun phase on loopback, in a private TMPDIR."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SUMMARY = re.compile(
    r"^SMOKE OK device=cpu tp=2 tokens=32 \| model [\d.]+s \| tp1 [\d.]+s \| tp2 [\d.]+s \| torchrun [\d.]+s "
    r"\| leaks [\d.]+s \| total [\d.]+s$", re.MULTILINE)


def run_smoke(*args: str) -> subprocess.CompletedProcess[str]:
    # A short private TMPDIR: the engine's IPC socket paths live in it (at most 100 bytes).
    tmpdir = tempfile.mkdtemp(prefix="tp-smoke-")
    try:
        env = {**os.environ, "TMPDIR": tmpdir, "GLOO_SOCKET_IFNAME": "lo", "PYTHON": sys.executable,
               "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run(["bash", str(REPO / "scripts" / "smoke_multi_gpu.sh"), *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=280)
        assert os.listdir(tmpdir) == [], f"left in TMPDIR: {os.listdir(tmpdir)}"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return proc


def test_smoke_script_passes_on_cpu_and_prints_its_summary() -> None:
    proc = run_smoke("--cpu-tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert SUMMARY.search(proc.stdout), proc.stdout
    assert len(re.findall(r"^SMOKE ", proc.stdout, re.MULTILINE)) == 1


def test_smoke_script_fails_loudly(tmp_path: Path) -> None:
    proc = run_smoke("--model", str(tmp_path / "no-such-model"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.search(r"^SMOKE FAIL device=cpu tp=2 tokens=None \| model [\d.]+s \| total [\d.]+s$", proc.stdout,
                     re.MULTILINE), proc.stdout
    assert "no-such-model" in proc.stdout
