"""The 60 s soak (scripts/soak.py) against its own TP=2 server: 100 requests with random
lengths, about a tenth cancelled by the client and a tenth of streams dropped mid-way.
Nothing may be lost, every accepted request finishes (completed or aborted), every KV
block is free at the end, RSS does not grow after warm-up, and the server stops cleanly.
The script's own checks decide; this test also holds it to the figures it reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


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
