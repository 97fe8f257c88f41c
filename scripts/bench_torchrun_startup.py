#!/usr/bin/env python3
"""Benchmark: time to a ready `engine.serve` at TP=2 under torchrun (the external
launcher) against the multiprocess backend, plus one request on each.

Usage: ``python scripts/bench_torchrun_startup.py [--reps 3] [--tp 2] [--model DIR]``

For each repetition, alternating, a fresh server is started and timed from the command's
launch until rank 0's ``/health`` answers 200 (imports, rendezvous, model load and KV
allocation on every rank; torchrun's own start included):

- mp:       ``python -m engine.serve MODEL --tp N`` (one engine process + N workers)
- torchrun: ``python -m torch.distributed.run --nproc-per-node N -m engine.serve MODEL --tp N
  --distributed-executor-backend external_launcher`` (N ranks, rank 0 serves)

Also read from the server's log: the EngineCore constructor's own time ("EngineCore
ready in"; under torchrun the slowest rank's). Then one warm-up and one timed greedy
/v1/completions request of 32 tokens, and SIGTERM. Everything is on 127.0.0.1. Prints
the min and max of each, and the ratio of the minima. Never part of the test suite's
pass/fail.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_common import die_with_parent, free_port

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def serve_command(kind: str, model: str, tp: int, port: int) -> list[str]:
    args = [model, "--tp", str(tp), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--max-model-len", "256", "--no-access-log", "--port", str(port), "--disable-log-stats"]
    if kind == "mp":
        return [sys.executable, "-m", "engine.serve", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), "-m", "engine.serve", *args,
            "--distributed-executor-backend", "external_launcher"]


def get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def post(url: str, body: bytes) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def one_run(kind: str, model: str, tp: int, tmpdir: str) -> tuple[float, float, float]:
    """(seconds to ready, EngineCore constructor seconds, seconds for one 32-token
    request) of a fresh server."""
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TMPDIR": tmpdir}
    log_path = Path(tmpdir) / f"{kind}.log"
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(serve_command(kind, model, tp, port), cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        while not get_ok(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited with {proc.returncode} before it was ready")
            time.sleep(0.05)
        ready = time.perf_counter() - start
        body = (b'{"model": "%s", "prompt": "Hello", "max_tokens": 32, "temperature": 0, "ignore_eos": true}'
                % model.encode())
        post(f"http://127.0.0.1:{port}/v1/completions", body)  # warm-up
        start = time.perf_counter()
        post(f"http://127.0.0.1:{port}/v1/completions", body)
        request = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    core = max(float(x) for x in re.findall(r"EngineCore ready in ([\d.]+)s", log_path.read_text()))
    return ready, core, request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", help="checkpoint with a tokenizer; default: a tiny random llama")
    args = parser.parse_args()
    from engine.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-torchrun-") as work:
        model = args.model or str(make_tiny_model(Path(work) / "model", "llama", with_tokenizer=True,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
        runs: dict[str, list[tuple[float, float, float]]] = {"mp": [], "torchrun": []}
        for rep in range(args.reps):
            for kind in runs:
                runs[kind].append(one_run(kind, model, args.tp, work))
                ready, core, request = runs[kind][-1]
                print(f"rep {rep} {kind:8s} ready {ready:.2f}s (EngineCore {core:.2f}s), 32-token request "
                      f"{request * 1000:.0f} ms", flush=True)
    for kind, results in runs.items():
        ready, core, request = (sorted(column) for column in zip(*results))
        print(f"{kind:8s} ready {ready[0]:.2f}-{ready[-1]:.2f}s, EngineCore {core[0]:.2f}-{core[-1]:.2f}s, "
              f"32-token request {request[0] * 1000:.0f}-{request[-1] * 1000:.0f} ms")
    best = {kind: min(r[0] for r in results) for kind, results in runs.items()}
    print(f"time to ready, torchrun / mp: {best['torchrun'] / best['mp']:.2f}x (best of {args.reps}); "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
