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
the runtime; tests/reliability/test_soak.py runs a 60 s version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_common import die_with_parent, free_port  # noqa: E402

MiB = 1 << 20
WORDS = ("the quick brown fox jumps over lazy dog once upon a time there was little model that "
         "learned to count numbers stars moon sea people stories morning school children").split()
# Conservative tokens per word for the tiny byte-level tokenizer (and any real one), so that
# prompt + max_tokens stays under max_model_len without tokenizing here.
TOKENS_PER_WORD = 8


# ----------------------------------------------------------------------------- metrics


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
    m = read_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    out = {reason: metric(m, FINISHED, reason) for reason in ("stop", "length", "abort", "error")}
    out.update(received=metric(m, RECEIVED), rejected=metric(m, REJECTED), kv_usage=metric(m, KV_USAGE),
               running=metric(m, RUNNING), waiting=metric(m, WAITING))
    return out


# ----------------------------------------------------------------------------- server


class Interrupted(KeyboardInterrupt):
    """A SIGTERM or SIGINT arrived (raised from the handler main() installs). A
    KeyboardInterrupt, so that no `except Exception` swallows it and asyncio lets it out
    of the event loop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def tree_rss(pid: int) -> int:
    """RSS of `pid` and every descendant (workers, forkserver), in bytes."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def rss_by_process(pid: int) -> dict[str, float]:
    """{"pid name": RSS MiB} of `pid` and its descendants: which process grew."""
    out: dict[str, float] = {}
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            out[f"{p.pid} {p.name()}"] = round(p.memory_info().rss / MiB, 1)
        except psutil.NoSuchProcess:
            pass
    return out


def pid_listening_on(port: int) -> int | None:
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


# ----------------------------------------------------------------------------- load


@dataclass
class Outcome:
    kind: str  # "complete" | "cancel" | "disconnect"
    stream: bool
    chat: bool
    max_tokens: int
    status: str = "pending"  # completed | cut_off | failed
    saw_output: bool = False  # the server surely accepted it (a stream event or a response)
    error: str = ""


@dataclass
class Plan:
    at: float
    body: dict[str, Any]
    outcome: Outcome
    cut_after: float = 0.0  # cancel: seconds after sending; disconnect: events to read
    events: int = 0


def make_plans(args: argparse.Namespace, max_model_len: int, chat: bool, rng: random.Random) -> list[Plan]:
    gaps = [rng.expovariate(1.0) for _ in range(args.requests)]
    scale = args.duration / sum(gaps) if sum(gaps) else 0.0
    plans, t = [], 0.0
    for gap in gaps:
        words = rng.randint(1, args.max_prompt_words)
        budget = max_model_len - words * TOKENS_PER_WORD - 8
        if budget < 1:
            words = max(1, (max_model_len - 16) // TOKENS_PER_WORD)
            budget = max(1, max_model_len - words * TOKENS_PER_WORD - 8)
        max_tokens = rng.randint(1, max(1, min(args.max_tokens, budget)))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        roll = rng.random()
        kind = ("cancel" if roll < args.cancel_fraction
                else "disconnect" if roll < args.cancel_fraction + args.disconnect_fraction else "complete")
        if kind == "cancel":
            # As long as the prompt allows, so that the cut (within 0.1 s) falls while it still
            # runs however fast the engine is: a short one cut after a random half second
            # mostly finished first once steps took ~1 ms.
            max_tokens = budget
        stream = True if kind == "disconnect" else rng.random() < args.stream_fraction
        use_chat = chat and rng.random() < 0.2
        body: dict[str, Any] = {"model": "soak", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                                "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1 << 30)}
        if use_chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
            if stream and kind == "disconnect":
                body["logprobs"] = 0  # every token makes an event, so "after N events" is mid-stream
        t += gap * scale
        plan = Plan(t, body, Outcome(kind, stream, use_chat, max_tokens))
        if kind == "cancel":
            plan.cut_after = rng.uniform(0.01, 0.1)
        elif kind == "disconnect":
            plan.events = rng.randint(1, max(1, max_tokens // 2))
        plans.append(plan)
    return plans


async def run_one(http: httpx.AsyncClient, url: str, plan: Plan) -> None:
    out = plan.outcome
    path = "/v1/chat/completions" if out.chat else "/v1/completions"
    try:
        if out.kind == "cancel":
            task = asyncio.ensure_future(_request(http, url + path, plan))
            done, _ = await asyncio.wait({task}, timeout=plan.cut_after)
            if not done:
                task.cancel()  # closes the connection: the server must abort the request
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                out.status = "cut_off" if out.status == "pending" else out.status
                return
            task.result()
            return
        await _request(http, url + path, plan)
    except Exception as e:  # noqa: BLE001 - any transport error or surprise is a lost request
        out.status, out.error = "failed", f"{type(e).__name__}: {e}"


async def _request(http: httpx.AsyncClient, url: str, plan: Plan) -> None:
    out = plan.outcome
    if not out.stream:
        response = await http.post(url, json=plan.body)
        out.saw_output = True
        if response.status_code != 200:
            out.status, out.error = "failed", f"HTTP {response.status_code}: {response.text[:200]}"
            return
        choice = response.json()["choices"][0]
        ok = choice.get("finish_reason") in ("length", "stop")
        out.status, out.error = ("completed", "") if ok else ("failed", f"finish_reason {choice.get('finish_reason')}")
        return
    async with http.stream("POST", url, json=plan.body) as response:
        if response.status_code != 200:
            out.status, out.error = "failed", f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        events, finish, done = 0, None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                out.status, out.error = "failed", f"stream error: {payload['error']}"
                return
            out.saw_output = True
            events += 1
            for choice in payload.get("choices") or []:
                finish = choice.get("finish_reason") or finish
            if out.kind == "disconnect" and events >= plan.events and finish is None:
                out.status = "cut_off"  # leaving the block closes the connection mid-stream
                return
        if done and finish in ("length", "stop"):
            out.status = "completed"
        else:
            out.status, out.error = "failed", f"stream ended without [DONE] or finish_reason ({finish}, {done})"


async def drive(args: argparse.Namespace, url: str, plans: list[Plan], pid: int | None,
                warmup_done: asyncio.Event, rss: dict[str, Any]) -> None:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    gate = asyncio.Semaphore(args.concurrency)
    finished = 0
    warmup_n = max(1, int(len(plans) * args.warmup_fraction))
    start = time.monotonic()

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as http:
        async def one(plan: Plan) -> None:
            nonlocal finished
            delay = start + plan.at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                await run_one(http, url, plan)
            finished += 1
            if finished == warmup_n and pid is not None:
                rss["warm"] = tree_rss(pid)
                rss["warm_by_process"] = rss_by_process(pid)
                rss["warm_at_request"] = finished
                warmup_done.set()

        async def sample() -> None:
            while True:
                await asyncio.sleep(5)
                if pid is not None:
                    rss["samples"].append(tree_rss(pid))

        sampler = asyncio.ensure_future(sample())
        try:
            await asyncio.gather(*(one(p) for p in plans))
        finally:
            sampler.cancel()


def wait_drained(url: str, timeout: float) -> dict[str, float]:
    """The books once nothing runs or waits and the KV cache is empty (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        b = books(url)
        if (b["running"] == 0 and b["waiting"] == 0 and b["kv_usage"] == 0) or time.monotonic() > deadline:
            return b
        time.sleep(0.2)


# ----------------------------------------------------------------------------- main


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


def check(report: Report, plans: list[Plan], before: dict[str, float], after: dict[str, float]) -> None:
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


def summary(r: Report) -> str:
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
    sys.exit(main())
