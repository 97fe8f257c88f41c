"""Soak test of the HTTP server: many requests over minutes, some of them cut off by the
client, and at the end nothing lost, no memory growth, every KV block free.

    python scripts/soak.py                       # 500 requests over 300 s, own TP=2 server
    python scripts/soak.py --requests 100 --duration 60 --json out.json
    python scripts/soak.py --url http://127.0.0.1:8000 [--server-pid PID]

Without --url it writes a tiny random llama (with tokenizer and chat template) to a
temporary directory and starts `python -m engine.serve` on it (CPU, loopback, a free
port); with --url it drives that server (RSS is then measured only if the server
process is found: --server-pid, or the process listening on the URL's port here).

The load: `--requests` arrivals spread at random over `--duration` seconds (a Poisson
process, re-scaled to end on time), at most `--concurrency` in flight. Each request is
a completion or (if the model has a chat template) a chat completion, streamed or not,
with a random prompt of 1..`--max-prompt-words` words and a random `max_tokens` in
1..`--max-tokens` (`ignore_eos`, so the length is what was asked), fitted under the
server's max_model_len. A `--cancel-fraction` of the requests, each as long as its prompt
allows, are cancelled by the client after a random 10-100 ms (the connection closes
mid-request), and a
`--disconnect-fraction` are streams the client drops after a random number of events.

The checks, each a line when it fails:
- none lost: every request the client did not cut off ended with 200 and a
  finish_reason (streams: and `data: [DONE]`); no transport error, no 5xx;
- the server's books balance (from /metrics): every request it accepted finished
  (stop, length or abort; none with error), none was rejected, and the ones that
  neither the client saw complete nor were cut off do not exist: accepted - completed
  lies between the cut-off requests the server had surely accepted (the client saw
  output) and all cut-off requests;
- after the load drains: no request running or waiting, KV-cache usage 0 (every block
  back in the free pool: cached prefix blocks count as free, as they are reclaimable);
- RSS (server process plus its workers, psutil) at the end is within
  `--rss-tolerance-mib` (plus `--rss-tolerance-pct`) of its value after warm-up (the
  first `--warmup-fraction` of the requests);
- /health is 200 at the end; an own server stops on SIGTERM with exit code 0, leaving
  no process behind.

Prints one summary line (`soak: PASS ...` or `soak: FAIL ...`) and exits 1 on any
failure. `--json PATH` writes the figures. Its temporary directory (checkpoint, server
log) is removed unless a check failed. SIGTERM or SIGINT stops the run: its own server
is stopped and the temporary directory removed, and it exits with 128 + the signal's
number, without a summary. Killed outright (SIGKILL, a harness's timeout), it takes its
own server with it: Linux sends the server SIGTERM when the script dies. Not part of
the runtime; tests/reliability/test_soak.py runs a 60 s version. The load is in
soak_load.py, the checks in soak_checks.py, its own server in soak_server.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from soak_checks import Report, books, check, check_rss, summary, wait_drained
from soak_load import drive, make_plans
from soak_server import OwnServer, pid_listening_on


class Interrupted(KeyboardInterrupt):
    """A SIGTERM or SIGINT arrived (raised from the handler main() installs). A
    KeyboardInterrupt, so that no `except Exception` swallows it and asyncio lets it out
    of the event loop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500, help="how many requests (default 500)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds over which they arrive (default 300)")
    p.add_argument("--url", default=None, help="drive this server instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    p.add_argument("--model", default=None, help="own server: this checkpoint (default: a tiny random llama)")
    p.add_argument("--tp", type=int, default=2, help="own server: tensor-parallel size (default 2)")
    p.add_argument("--max-model-len", type=int, default=256, help="own server: --max-model-len (default 256)")
    p.add_argument("--kv-cache-memory", default="16MiB", help="own server: --kv-cache-memory (default 16MiB)")
    p.add_argument("--server-arg", action="append", default=[], help="own server: one more argument (repeatable)")
    p.add_argument("--concurrency", type=int, default=32, help="most requests in flight (default 32)")
    p.add_argument("--max-prompt-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens drawn (default 64)")
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="cancelled by the client mid-request")
    p.add_argument("--disconnect-fraction", type=float, default=0.1, help="streams dropped mid-way")
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="RSS baseline after this share of requests")
    p.add_argument("--rss-tolerance-mib", type=float, default=32.0, help="allowed RSS growth after warm-up")
    p.add_argument("--rss-tolerance-pct", type=float, default=2.0, help="... plus this percentage of it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    report = Report(args.requests)
    workdir = Path(tempfile.mkdtemp(prefix="tp-soak-"))
    server = OwnServer(args, workdir) if args.url is None else None
    interrupted: Interrupted | None = None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_interrupted)
    try:
        if server is not None:
            server.start()
            url, pid = server.url, server.proc.pid if server.proc else None
        else:
            url = args.url.rstrip("/")
            pid = args.server_pid or pid_listening_on(httpx.URL(url).port or 80)
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        max_model_len = int(card.get("max_model_len") or 2048)
        probe = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": card["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        chat = probe.status_code == 200
        plans = make_plans(args, max_model_len, chat, rng)
        for plan in plans:
            plan.body["model"] = card["id"]
        before = books(url)
        rss: dict[str, Any] = {"samples": []}
        t0 = time.monotonic()
        asyncio.run(drive(args, url, plans, pid, asyncio.Event(), rss))
        report.duration_s = round(time.monotonic() - t0, 1)
        after = wait_drained(url, timeout=60)
        check(report, plans, before, after)
        if pid is not None and "warm" in rss:
            check_rss(report, args, pid, rss)
        health = httpx.get(f"{url}/health", timeout=30)
        if health.status_code != 200:
            report.failures.append(f"/health is {health.status_code} at the end: {health.text[:200]}")
    except Interrupted as e:
        interrupted = e
    except Exception as e:  # noqa: BLE001 - reported as a failure, with the server log
        report.failures.append(f"{type(e).__name__}: {e}")
        if server is not None:
            report.failures.append("server log tail:\n" + server.log()[-3000:])
    finally:
        # A second signal must not cut the server's stop short.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
        if server is not None:
            report.server_exit_code, report.leftover_pids = server.stop()
            if report.server_exit_code != 0:
                report.failures.append(f"the server exited with {report.server_exit_code} on SIGTERM; log tail:\n"
                                       + server.log()[-3000:])
            if report.leftover_pids:
                report.failures.append(f"processes left after the server stopped: {report.leftover_pids}")
    if interrupted is not None:
        shutil.rmtree(workdir, ignore_errors=True)
        left = f"; processes left: {report.leftover_pids}" if report.leftover_pids else ""
        print(f"soak: stopped by {interrupted}{left}", file=sys.stderr, flush=True)
        return 128 + interrupted.signum
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    if report.failures and server is not None:
        print(f"soak: the server's log and checkpoint are kept in {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    for failure in report.failures:
        print(f"soak: FAILED CHECK: {failure}", file=sys.stderr)
    for error in report.errors[:10]:
        print(f"soak: lost request: {error}", file=sys.stderr)
    print(summary(report), flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
