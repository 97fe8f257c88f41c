#!/usr/bin/env python3
"""Benchmark: the Ray backend against the multiprocess one, at TP=2 on this host.

Usage: ``python scripts/bench_ray.py [--reps 3] [--calls 300] [--tp 2]``

Each repetition runs each mode in a fresh Python process (``engine.core`` already
imported), with a tiny llama on the CPU:

- mp: ``distributed_executor_backend="mp"``; the first engine of the process (forkserver
  cold) and a second one (warm).
- ray, joined: the child first starts a local Ray instance itself (``ray.init``, timed
  apart), then builds the engines, which join it; the time a cluster that is already up
  adds to an engine.
- ray, started: no cluster anywhere; the first engine starts a local instance itself, so
  its time includes Ray's own start-up.

After the first engine is ready, the median (and p90) of ``--calls`` no-op
``collective_rpc`` calls: a Worker method by name ("check_health"), and a cloudpickled
callable. Ray gets a node IP on loopback (127.0.0.2) and a private temp dir, usage
statistics and token authentication off. Never part of the test suite's pass/fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import REPO, latencies, load_average, parse_result, print_result

MODES = ("mp", "ray-joined", "ray-started")
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TP_RAY_NODE_IP": "127.0.0.2"}
ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=256,
                 use_tqdm_on_load=False)
CHILD_TIMEOUT_S = 300


def _noop(worker: object) -> None:
    return None


def child_main(args: argparse.Namespace) -> None:
    """One mode in this fresh interpreter: two engines one after another, RPC latency on the first."""
    from engine.arg_utils import create_engine_config
    from engine.core import EngineCore

    ray_init_s = None
    if args.child == "ray-joined":
        import ray

        start = time.perf_counter()
        ray.init(address="local", include_dashboard=False, _node_ip_address=os.environ["TP_RAY_NODE_IP"])
        ray_init_s = time.perf_counter() - start
    backend = "mp" if args.child == "mp" else "ray"
    ready, rpc = [], {}
    for i in range(2):
        config = create_engine_config(model=args.model, tensor_parallel_size=args.tp, distributed_executor_backend=backend,
                                      **ENGINE_KW)
        start = time.perf_counter()
        core = EngineCore(config)
        ready.append(time.perf_counter() - start)
        if i == 0:
            rpc = {"by_name": latencies(lambda: core.collective_rpc("check_health"), args.calls, 20),
                   "callable": latencies(lambda: core.collective_rpc(_noop), args.calls, 20)}
        # ray-started: this shutdown stops the instance, so the second engine starts its own.
        core.shutdown()
    print_result(dict(ready=ready, rpc=rpc, ray_init_s=ray_init_s))


def run_child(mode: str, model: str, tp: int, calls: int) -> dict:
    ray_tmp = tempfile.mkdtemp(prefix="tb", dir="/tmp")  # short: Ray's unix sockets live under it
    env = dict(os.environ, **RAY_ENV, RAY_TMPDIR=ray_tmp)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", model, "--tp", str(tp),
           "--calls", str(calls)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=REPO)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return parse_result(proc.stdout, proc.stderr, proc.returncode, f"{mode} child")


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--model", default=None, help="checkpoint dir (default: a cached tiny llama)")
    p.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child_main(args)
        return
    if args.model is None:
        from bench_startup import tiny_model_dir

        args.model = tiny_model_dir()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for rep in range(args.reps):
        for mode in MODES:  # alternating, so background load hits every mode alike
            runs[mode].append(run_child(mode, args.model, args.tp, args.calls))
            print(f"rep {rep + 1}/{args.reps} {mode}: ready {runs[mode][-1]['ready']}", file=sys.stderr, flush=True)
    print(f"TP={args.tp}, tiny llama on CPU, medians of {args.reps} fresh processes; load average "
          f"{load_average()}")
    print("| mode | ray.init | first engine ready | second engine ready | no-op RPC by name (p90) "
          "| no-op RPC callable (p90) |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        rs = runs[mode]
        init = [r["ray_init_s"] for r in rs if r["ray_init_s"] is not None]
        by_name = [x for r in rs for x in r["rpc"]["by_name"]]
        fn = [x for r in rs for x in r["rpc"]["callable"]]

        def p90(xs: list[float]) -> str:
            return f"{sorted(xs)[int(0.9 * len(xs))] * 1e3:.2f}"

        print(f"| {mode} | {f'{statistics.median(init):.2f} s' if init else '-'} "
              f"| {statistics.median(r['ready'][0] for r in rs):.2f} s "
              f"| {statistics.median(r['ready'][1] for r in rs):.2f} s "
              f"| {_ms(by_name)} ms ({p90(by_name)}) | {_ms(fn)} ms ({p90(fn)}) |")


if __name__ == "__main__":
    main()
