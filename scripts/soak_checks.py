"""The checks of scripts/soak.py: the server's books from /metrics, the client's
outcomes against them, the RSS after warm-up, and the report with its summary line.

Imported by bare name from soak.py (scripts/ is not a package); not a script of its own:
`python scripts/soak.py --help` lists the checks. Each failed check appends one line to
`Report.failures`; soak.py prints them and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from soak_load import Plan
from soak_server import MiB, rss_by_process, tree_rss

_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def read_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {name without the `tp_runtime_` / `tp_runtime:` prefix: [(labels, value)]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        name = re.sub(r"^tp_runtime[:_]", "", match.group(1))
        labels = dict(_LABEL.findall(match.group(2) or ""))
        out.setdefault(name, []).append((labels, float(match.group(3))))
    return out


def metric(metrics: dict[str, list[tuple[dict[str, str], float]]], names: tuple[str, ...],
           reason: str | None = None) -> float:
    """The sum of the first of `names` present (over its label sets; with `reason`, only
    the series whose finish-reason label is it). The names cover the metric renames."""
    for name in names:
        if name in metrics:
            return sum(v for labels, v in metrics[name]
                       if reason is None or reason in (labels.get("finished_reason"), labels.get("finish_reason")))
    raise KeyError(f"none of the metrics {names} is exported")


FINISHED = ("request_success_total", "requests_finished_total")
RECEIVED = ("requests_received_total",)
REJECTED = ("requests_rejected_total",)
KV_USAGE = ("kv_cache_usage_perc", "kv_cache_usage_ratio", "gpu_cache_usage_perc")
RUNNING = ("num_requests_running",)
WAITING = ("num_requests_waiting",)


def books(url: str) -> dict[str, float]:
    """The server's counters now: finished by reason, received, rejected, KV usage, running, waiting."""
    m = read_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    out = {reason: metric(m, FINISHED, reason) for reason in ("stop", "length", "abort", "error")}
    out.update(received=metric(m, RECEIVED), rejected=metric(m, REJECTED), kv_usage=metric(m, KV_USAGE),
               running=metric(m, RUNNING), waiting=metric(m, WAITING))
    return out


def wait_drained(url: str, timeout: float) -> dict[str, float]:
    """The books once nothing runs or waits and the KV cache is empty (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        b = books(url)
        if (b["running"] == 0 and b["waiting"] == 0 and b["kv_usage"] == 0) or time.monotonic() > deadline:
            return b
        time.sleep(0.2)


@dataclass
class Report:
    requests: int
    duration_s: float = 0.0
    completed: int = 0
    cut_off: int = 0
    cancelled: int = 0
    disconnected: int = 0
    cut_off_seen_accepted: int = 0
    failed: int = 0
    lost: int = 0
    server: dict[str, float] = field(default_factory=dict)
    rss_warm_mib: float | None = None
    rss_end_mib: float | None = None
    rss_max_mib: float | None = None
    rss_tolerance_mib: float | None = None
    rss_samples_mib: list[float] = field(default_factory=list)  # every 5 s during the load
    rss_by_process_mib: dict[str, list[float]] = field(default_factory=dict)  # after warm-up, at the end
    server_exit_code: int | None = None
    leftover_pids: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def check(report: Report, plans: list[Plan], before: dict[str, float], after: dict[str, float]) -> None:
    """The client's outcomes against the server's books (`after` - `before`), and the
    server drained: fills in the counts and appends a failure per broken check."""
    outcomes = [p.outcome for p in plans]
    report.completed = sum(o.status == "completed" for o in outcomes)
    cut = [o for o in outcomes if o.status == "cut_off"]
    report.cut_off = len(cut)
    report.cancelled = sum(o.kind == "cancel" for o in cut)
    report.disconnected = sum(o.kind == "disconnect" for o in cut)
    report.cut_off_seen_accepted = sum(o.saw_output for o in cut)
    failed = [o for o in outcomes if o.status not in ("completed", "cut_off")]
    report.failed = len(failed)
    report.errors = [f"{o.kind} stream={o.stream} chat={o.chat}: {o.error or o.status}" for o in failed]
    delta = {k: after[k] - before[k] for k in ("stop", "length", "abort", "error", "received", "rejected")}
    report.server = {**{k: int(v) for k, v in delta.items()}, "kv_usage_end": after["kv_usage"],
                     "running_end": int(after["running"]), "waiting_end": int(after["waiting"])}
    finished = delta["stop"] + delta["length"] + delta["abort"] + delta["error"]
    # Lost: accepted by the server but neither finished there, nor seen complete or cut off here.
    report.lost = int(max(0, delta["received"] - finished)) + report.failed
    if report.failed:
        report.failures.append(f"{report.failed} request(s) failed or ended incomplete (first: {report.errors[0]})")
    if delta["received"] != finished:
        report.failures.append(f"the server accepted {delta['received']:.0f} requests but finished {finished:.0f}")
    if delta["error"]:
        report.failures.append(f"{delta['error']:.0f} request(s) finished with an error in the server")
    if delta["rejected"]:
        report.failures.append(f"{delta['rejected']:.0f} valid request(s) were rejected")
    server_cut = delta["received"] - report.completed  # accepted requests the client did not see complete
    if not report.cut_off_seen_accepted <= server_cut <= report.cut_off:
        report.failures.append(
            f"books disagree: the server accepted {delta['received']:.0f}, the client saw {report.completed} complete "
            f"and cut off {report.cut_off} ({report.cut_off_seen_accepted} surely accepted)")
    if delta["abort"] > report.cut_off:
        report.failures.append(f"{delta['abort']:.0f} aborts in the server but only {report.cut_off} cut off here")
    if after["running"] or after["waiting"]:
        report.failures.append(f"after the load: {after['running']:.0f} running, {after['waiting']:.0f} waiting")
    if after["kv_usage"] != 0:
        report.failures.append(f"after the load the KV cache is {100 * after['kv_usage']:.2f}% used, not empty")


def check_rss(report: Report, args: argparse.Namespace, pid: int, rss: dict[str, Any]) -> None:
    """The server tree's RSS now against its value after warm-up (`rss` as soak_load's
    `drive` filled it, "warm" included), within --rss-tolerance-mib plus
    --rss-tolerance-pct of it: fills in the RSS figures, appends a failure if it grew more."""
    end = tree_rss(pid)
    warm = rss["warm"]
    tolerance = args.rss_tolerance_mib * MiB + warm * args.rss_tolerance_pct / 100
    report.rss_warm_mib, report.rss_end_mib = round(warm / MiB, 1), round(end / MiB, 1)
    report.rss_max_mib = round(max([end, *rss["samples"]]) / MiB, 1)
    report.rss_tolerance_mib = round(tolerance / MiB, 1)
    report.rss_samples_mib = [round(x / MiB, 1) for x in rss["samples"]]
    end_by = rss_by_process(pid)
    report.rss_by_process_mib = {k: [v, end_by.get(k, 0.0)] for k, v in rss["warm_by_process"].items()}
    if end - warm > tolerance:
        report.failures.append(f"RSS grew after warm-up: {warm / MiB:.1f} -> {end / MiB:.1f} MiB "
                               f"(+{(end - warm) / MiB:.1f}, tolerance {tolerance / MiB:.1f})")


def summary(r: Report) -> str:
    """The one line soak.py prints last: `soak: PASS ...` or `soak: FAIL ...`."""
    verdict = "FAIL" if r.failures else "PASS"
    s = r.server
    rss = (f"RSS {r.rss_warm_mib} -> {r.rss_end_mib} MiB after warm-up (max {r.rss_max_mib}, tolerance "
           f"+{r.rss_tolerance_mib})" if r.rss_warm_mib is not None else "RSS not measured")
    return (f"soak: {verdict} {r.requests} requests in {r.duration_s} s: {r.completed} completed, {r.cut_off} cut off "
            f"by the client ({r.cancelled} cancelled, {r.disconnected} streams dropped), {r.lost} lost, "
            f"{r.failed} failed; server: {s.get('received', '?')} accepted, {s.get('abort', '?')} aborted, "
            f"{s.get('error', '?')} errors, KV usage {s.get('kv_usage_end', '?')} at the end; {rss}; "
            f"server exit {r.server_exit_code}")


if __name__ == "__main__":
    print(__doc__)
