#!/usr/bin/env python3
"""Benchmark: time to a ready EngineCore at TP 1/2/4 against a bare torch.distributed baseline.

Usage: ``python scripts/bench_startup.py [--reps 3] [--tp 1 2 4] [--model DIR]``

What is timed (median of ``--reps`` repetitions):

- baseline: in this process, ``multiprocessing`` (spawn) starts N processes that each
  ``import torch``, ``init_process_group("gloo")`` on a FileStore in a private temp dir,
  run one ``all_reduce`` and report back over a pipe; from just before the first
  ``Process.start()`` until the last report arrives.
- ours, forkserver cold: the EngineCore constructor call (until it returns) of the first
  engine in a fresh Python process (one fresh subprocess per repetition); this includes
  starting the forkserver and its torch preload. The subprocess has already imported
  ``engine.core`` (the import time is shown separately).
- ours, forkserver warm: the second engine in that same process (forkserver running).
- ours, spawn: ``TP_WORKER_MULTIPROC_METHOD=spawn``, first engine in a fresh process.

Ours always uses ``distributed_executor_backend="mp"`` (one worker process per rank, also
at TP=1, so every row is comparable with the baseline); the in-process ``uni`` backend,
the default at TP=1, is shown as one extra row. The per-phase breakdown comes from
``core.startup_timings`` (worker phases are the max over ranks) plus the executor's own
``startup_total`` (spawn + wait for every READY).

Then, unless ``--launchers`` is given empty, the Ray and torchrun backends at TP=2, each
next to mp in alternating runs: ``bench_ray.py`` (time to ready, no-op collective_rpc
latency by name and by callable) and ``bench_torchrun_startup.py`` (engine.serve time
to ready and one request).

Target: engine ready at TP=4 <= 1.0x the baseline at TP=4. This script is never part of
the test suite's pass/fail.
"""

from __future__ import annotations

# Keep the module-level imports light (bench_common included: it is imported where it is
# used): spawned baseline workers re-import this file as __mp_main__, and must not pay
# for (or time) anything but their own `import torch`.
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

TARGET_RATIO = 1.0
TINY_SPEC = dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, seed=0, num_shards=2, with_tokenizer=False)
ENGINE_KW = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=256)
CHILD_TIMEOUT_S = 180


# ---------------------------------------------------------------------------- model

def tiny_model_dir() -> str:
    """A cached tiny checkpoint under the temp dir, keyed by its spec (made once)."""
    key = hashlib.sha1(json.dumps(TINY_SPEC, sort_keys=True).encode()).hexdigest()[:10]
    out = os.path.join(tempfile.gettempdir(), f"tp-bench-tiny-llama-{key}")
    if not os.path.exists(os.path.join(out, "config.json")):
        from engine.tiny_model import make_tiny_model

        spec = dict(TINY_SPEC)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=os.path.dirname(out))
        make_tiny_model(tmp, spec.pop("arch"), **spec)
        try:
            os.rename(tmp, out)  # atomic: a concurrent run either wins or finds it made
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------- baseline

def _baseline_worker(rank: int, world_size: int, init_method: str, conn) -> None:  # runs in a spawned child
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    conn.send((rank, float(t.item())))
    conn.close()
    dist.destroy_process_group()


def run_baseline(world_size: int) -> float:
    """Seconds from the first Process.start() until every rank reported its all_reduce."""
    import multiprocessing as mp
    import shutil
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tp-bench-baseline-")
    init_method = f"file://{os.path.join(tmp, 'store')}"
    try:
        start = time.perf_counter()
        procs, readers = [], []
        for rank in range(world_size):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_baseline_worker, args=(rank, world_size, init_method, w), daemon=True)
            p.start()
            w.close()
            procs.append(p)
            readers.append(r)
        pending = set(readers)
        while pending:
            for conn in wait(list(pending), timeout=CHILD_TIMEOUT_S):
                rank, value = conn.recv()
                if value != world_size:
                    raise RuntimeError(f"baseline rank {rank}: all_reduce gave {value}, expected {world_size}")
                pending.discard(conn)
        elapsed = time.perf_counter() - start
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        return elapsed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- ours (child)

def child_main(args: argparse.Namespace) -> None:
    """Runs in a fresh interpreter: build `--engines` engines one after another, print timings."""
    t0 = time.perf_counter()
    from engine.arg_utils import create_engine_config
    from engine.core import EngineCore

    import_s = time.perf_counter() - t0
    runs = []
    backends = ["mp"] * args.engines + (["uni"] if args.with_uni else [])
    for backend in backends:
        config = create_engine_config(model=args.model, tensor_parallel_size=args.child_tp, distributed_executor_backend=backend,
                                      **ENGINE_KW)
        start = time.perf_counter()
        core = EngineCore(config)
        ready_s = time.perf_counter() - start
        timings = {k: v for k, v in core.startup_timings.items() if k != "per_rank"}
        timings["startup_total"] = core.model_executor.startup_timings.get("startup_total", 0.0)
        t1 = time.perf_counter()
        core.shutdown()
        shutdown_s = time.perf_counter() - t1
        runs.append(dict(backend=backend, ready_s=ready_s, shutdown_s=shutdown_s, timings=timings))
    from bench_common import print_result  # not at the top: see the imports there

    print_result(dict(import_s=import_s, runs=runs))


def run_child(model: str, tp: int, method: str, engines: int, with_uni: bool = False) -> dict:
    env = dict(os.environ, TP_WORKER_MULTIPROC_METHOD=method)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--child-tp", str(tp),
           "--engines", str(engines)] + (["--with-uni"] if with_uni else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=REPO)
    from bench_common import parse_result

    return parse_result(proc.stdout, proc.stderr, proc.returncode, f"child (tp={tp}, {method})")


# ---------------------------------------------------------------------------- report

def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="tensor-parallel sizes")
    p.add_argument("--reps", type=int, default=3, help="repetitions per measurement (median reported)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: a cached tiny llama)")
    p.add_argument("--launchers", nargs="*", default=["ray", "torchrun"], choices=["ray", "torchrun"],
                   help="also time these backends at TP=2 next to mp, in the same run (bench_ray.py: ready and "
                        "no-op RPC latency; bench_torchrun_startup.py: engine.serve ready); none: skip")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--engines", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--with-uni", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child_main(args)
        return

    from bench_common import load_average

    wall = time.perf_counter()
    model = args.model or tiny_model_dir()
    print(f"bench_startup: model={model}")
    print(f"host: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, load average at start {load_average()}")
    print(f"engine config: {ENGINE_KW}, distributed_executor_backend='mp'; reps={args.reps} (median)\n")

    rows: dict[str, dict[int, list[float]]] = {k: {tp: [] for tp in args.tp} for k in
                                               ("baseline", "fs_cold", "fs_warm", "spawn", "uni")}
    phases: dict[str, dict[int, list[dict]]] = {k: {tp: [] for tp in args.tp} for k in ("fs_cold", "fs_warm", "spawn")}
    imports: list[float] = []
    # Interleave the kinds within each repetition so that a burst of background load hits
    # all of them alike rather than one column.
    for rep in range(args.reps):
        for tp in args.tp:
            rows["baseline"][tp].append(run_baseline(tp))
            res = run_child(model, tp, "forkserver", engines=2, with_uni=(tp == 1))
            imports.append(res["import_s"])
            cold, warm = res["runs"][0], res["runs"][1]
            rows["fs_cold"][tp].append(cold["ready_s"])
            rows["fs_warm"][tp].append(warm["ready_s"])
            phases["fs_cold"][tp].append(cold)
            phases["fs_warm"][tp].append(warm)
            if tp == 1:
                rows["uni"][tp].append(res["runs"][2]["ready_s"])
            res = run_child(model, tp, "spawn", engines=1)
            rows["spawn"][tp].append(res["runs"][0]["ready_s"])
            phases["spawn"][tp].append(res["runs"][0])
        print(f"  rep {rep + 1}/{args.reps} done ({time.perf_counter() - wall:.0f}s, load {load_average()})",
              flush=True)

    labels = {
        "baseline": "baseline: spawn+import torch+gloo init+all_reduce",
        "fs_cold": "ours forkserver, cold (1st engine, fresh process)",
        "fs_warm": "ours forkserver, warm (2nd engine, same process)",
        "spawn": "ours spawn (1st engine, fresh process)",
        "uni": "ours uni backend (in-process, tp=1 default)",
    }
    width = max(len(v) for v in labels.values())
    print("\nTime to ready (seconds, median of %d; min..max in brackets)" % args.reps)
    print(f"{'':{width}}" + "".join(f" | {'TP=' + str(tp):>20}" for tp in args.tp))
    print("-" * (width + 23 * len(args.tp)))
    for key, label in labels.items():
        cells = []
        for tp in args.tp:
            xs = rows[key][tp]
            cells.append(f"{med(xs):6.3f} [{min(xs):.2f}..{max(xs):.2f}]" if xs else "-")
        print(f"{label:{width}}" + "".join(f" | {c:>20}" for c in cells))
    print(f"(fresh-process `import engine.core` before the cold engine, not included above: "
          f"median {med(imports):.3f}s)")

    print("\nRatio ours / baseline (median)")
    print(f"{'':{width}}" + "".join(f" | {'TP=' + str(tp):>8}" for tp in args.tp))
    for key in ("fs_cold", "fs_warm", "spawn"):
        cells = [f"{med(rows[key][tp]) / med(rows['baseline'][tp]):7.2f}x" for tp in args.tp]
        print(f"{labels[key]:{width}}" + "".join(f" | {c:>8}" for c in cells))

    tp_t = 4 if 4 in args.tp else max(args.tp)
    base = med(rows["baseline"][tp_t])
    print(f"\nTarget: engine ready at TP={tp_t} <= {TARGET_RATIO:.1f}x baseline ({base:.3f}s)")
    for key in ("fs_cold", "fs_warm", "spawn"):
        ratio = med(rows[key][tp_t]) / base
        verdict = "PASS" if ratio <= TARGET_RATIO else "MISS"
        headline = "  <- headline (default start method, first engine)" if key == "fs_cold" else ""
        print(f"  {labels[key]:{width}}: {med(rows[key][tp_t]):.3f}s = {ratio:.2f}x  {verdict}{headline}")

    print("\nPer-phase breakdown (seconds, median over reps; worker phases are the max over ranks)")
    print("  total      = EngineCore constructor (core.startup_timings['total'])")
    print("  spawn      = the Process.start() calls (forkserver cold: includes the forkserver's torch preload)")
    print("  ready_wait = after spawn until every rank sent READY (executor startup_total - spawn), of which")
    print("    dist_init, load = worker phases; child_boot = ready_wait - dist_init - load (interpreter/imports,")
    print("    unpickling the config, queue attach + readiness handshake)")
    print("  profile, kv_alloc = worker phases run by RPC; rpc_rest = total - startup_total - profile - kv_alloc")
    print("  shutdown   = core.shutdown() (not part of total)")
    cols = ("total", "spawn", "ready_wait", "dist_init", "load", "child_boot", "profile", "kv_alloc", "rpc_rest",
            "shutdown")
    print(f"{'mode':<9}{'TP':>3}" + "".join(f"{c:>11}" for c in cols))
    for key in ("fs_cold", "fs_warm", "spawn"):
        for tp in args.tp:
            per_run = []
            for r in phases[key][tp]:
                t = r["timings"]
                ready_wait = t["startup_total"] - t["spawn"]
                per_run.append(dict(
                    total=t["total"], spawn=t["spawn"], ready_wait=ready_wait, dist_init=t["distributed_init"],
                    load=t["load"], child_boot=ready_wait - t["distributed_init"] - t["load"],
                    profile=t["profile"], kv_alloc=t["kv_alloc"],
                    rpc_rest=t["total"] - t["startup_total"] - t["profile"] - t["kv_alloc"],
                    shutdown=r["shutdown_s"]))
            print(f"{key:<9}{tp:>3}" + "".join(f"{med([x[c] for x in per_run]):>11.3f}" for c in cols))
    # The other backends, each against mp again in its own alternating runs (their own
    # scripts, so that each can also be run alone).
    scripts = {"ray": "bench_ray.py", "torchrun": "bench_torchrun_startup.py"}
    for launcher in args.launchers:
        print(f"\n=== TP=2: {launcher} next to mp ({scripts[launcher]}) ===", flush=True)
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), scripts[launcher]),
               "--reps", str(args.reps), "--tp", "2"]
        if args.model and launcher == "ray":  # the torchrun one serves HTTP: it makes a model with a tokenizer
            cmd += ["--model", args.model]
        if subprocess.run(cmd).returncode != 0:
            print(f"{launcher}: its benchmark failed (is the extra installed? pip install -e \".[ray]\")")
    print(f"\nload average at end {load_average()}; wall time {time.perf_counter() - wall:.0f}s")


if __name__ == "__main__":
    main()
