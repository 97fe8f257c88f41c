#!/usr/bin/env python3
"""Benchmark: how fast and how lean is `model_loader.get_model()` on CPU?

Generates (once, cached under --dir) a ~1.3 GB bfloat16 llama checkpoint with
engine/tiny_model.py, warms the page cache, then measures each case in a fresh
Python process, one after the other:

  plain-read        os.readinto of every file into one reusable buffer (the ceiling)
  safetensors       safetensors.torch.load_file of every shard
  transformers      AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16)
  ours              get_model(create_engine_config(model=dir, device="cpu"))   (dtype auto)
  ours-lazy/-eager/-prefetch   the same with each safetensors_load_strategy
  ours-tp2          two gloo ranks, each loading its shard (per-rank numbers)
  ours-thp          (diagnostic, only with --cases) `ours` with THP_MEM_ALLOC_ENABLE=1

A case's clock runs from just before the load call until every weight is resident:
after loading, one byte of every 4 KiB page of every parameter is read inside the timed
region. Imports (and, for TP, the process-group rendezvous) happen before the clock
starts. Peak RSS growth is the peak RSS during the case minus the RSS just before it,
taken from the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs)
and cross-checked by a 1 ms psutil sampler and getrusage's ru_maxrss.

Targets (for `ours`): >= 4x faster than transformers, >= 50% of the plain-read rate,
peak RSS growth <= 1.2x the weight bytes. This script is never part of the test suite.

Usage: python scripts/bench_load.py [--quick] [--dir .bench/load_model] [--repeat N]
       [--cases ours,transformers,...] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench_common import (
    GB,
    REPO,
    Meter,
    add_child_args,
    child_env,
    comma_list,
    ensure_checkpoint,
    free_port,
    join_tp_group,
    leave_tp_group,
    median_run,
    param_bytes,
    plain_read,
    print_result,
    run_children,
    touch_all,
    warm_page_cache,
    weight_bytes,
    weight_files,
)

FULL_SPEC: dict[str, Any] = dict(  # ~1.34 GB of bf16 weights
    arch="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
    num_key_value_heads=4, vocab_size=32000, num_shards=4, dtype="bfloat16", max_position_embeddings=2048,
)
QUICK_SPEC: dict[str, Any] = dict(  # ~0.2 GB
    arch="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
    num_key_value_heads=4, vocab_size=16000, num_shards=2, dtype="bfloat16", max_position_embeddings=2048,
)
SINGLE_CASES = ["plain-read", "safetensors", "transformers", "ours", "ours-lazy", "ours-eager", "ours-prefetch"]
# Diagnostic: `ours` with torch's transparent-huge-page allocations (THP_MEM_ALLOC_ENABLE=1),
# which shows how much of our time is first-touch page faults on the new parameters.
DIAGNOSTIC_CASES = ["ours-thp"]
DEFAULT_CASES = [*SINGLE_CASES, "ours-tp2"]
ALL_CASES = [*DEFAULT_CASES, *DIAGNOSTIC_CASES]
TARGET_SPEEDUP_VS_HF = 4.0
TARGET_FRACTION_OF_PLAIN_READ = 0.5
TARGET_PEAK_RATIO = 1.2


# --------------------------------------------------------------------------- child


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    case, model_dir = args.child, Path(args.model_dir)
    files = weight_files(model_dir)
    import torch

    if case == "ours-tp2":
        torch.set_num_threads(1)
    load: Callable[[], Any]
    if case == "plain-read":
        buffer = bytearray(64 << 20)
        buffer[:] = bytes(len(buffer))  # fault the buffer in before the clock starts

        def load() -> Any:
            plain_read(files, buffer)
            return []

    elif case == "safetensors":
        from safetensors.torch import load_file

        def load() -> Any:
            tensors = []
            for path in files:
                tensors.extend(load_file(str(path)).values())
            return tensors

    elif case == "transformers":
        from transformers import AutoModelForCausalLM

        def load() -> Any:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
            return list(model.parameters())

    elif case.startswith("ours"):
        import model_loader.default_loader  # noqa: F401  (imports outside the clock)
        import models.llama  # noqa: F401
        from engine.arg_utils import create_engine_config
        from model_loader import get_model

        strategy = {"ours-lazy": "lazy", "ours-eager": "eager", "ours-prefetch": "prefetch"}.get(case)
        tp = 1
        if case == "ours-tp2":
            tp = args.world
            join_tp_group(args.rank, tp, args.port)
        config = create_engine_config(model=str(model_dir), device="cpu", tensor_parallel_size=tp,
                                      safetensors_load_strategy=strategy)

        def load() -> Any:
            return list(get_model(config).parameters())

    else:
        raise SystemExit(f"unknown case {case!r}")

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    with Meter() as meter:
        if profiler is not None:
            profiler.enable()
        tensors = load()
        touch_all(tensors)
        if profiler is not None:
            profiler.disable()
    result = dict(meter.result, case=case, rank=args.rank, param_bytes=param_bytes(tensors),
                  threads=torch.get_num_threads())
    if profiler is not None:
        import io
        import pstats

        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        result["profile"] = out.getvalue()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        result["profile_tottime"] = out.getvalue()
    if case == "ours-tp2":
        leave_tp_group()
    return result


# --------------------------------------------------------------------------- orchestration (parent side)


def _child_cmd(case: str, model_dir: Path, profile: bool, rank: int = 0, world: int = 1, port: int = 0) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--model-dir", str(model_dir),
           "--rank", str(rank), "--world", str(world), "--port", str(port)]
    return cmd + (["--profile"] if profile else [])


def run_case(case: str, model_dir: Path, profile: bool, timeout: float = 600) -> list[dict[str, Any]]:
    """One fresh process (two for TP=2); returns one result per rank."""
    env = child_env()
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if case == "ours-thp":
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if case != "ours-tp2":
        return run_children([_child_cmd(case, model_dir, profile)], case, env, timeout)
    port = free_port()
    return run_children([_child_cmd(case, model_dir, profile, rank, 2, port) for rank in range(2)], case, env,
                        timeout)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(REPO / ".bench" / "load_model"), help="checkpoint cache directory")
    p.add_argument("--quick", action="store_true", help="a ~0.2 GB model instead of ~1.3 GB")
    p.add_argument("--repeat", type=int, default=3, help="runs per case (the median run is reported)")
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"comma-separated cases (default: all but the diagnostic ones) from {ALL_CASES}")
    p.add_argument("--profile", action="store_true", help="cProfile the 'ours*' cases and print the top entries")
    add_child_args(p)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        print_result(run_child(args))
        return

    cases = comma_list(p, args.cases, ALL_CASES, "case")
    spec = QUICK_SPEC if args.quick else FULL_SPEC
    model_dir = ensure_checkpoint(Path(args.dir), spec)
    files = weight_files(model_dir)
    wbytes = weight_bytes(model_dir)
    t0 = time.perf_counter()
    warm_page_cache(files)
    print(f"model: {model_dir}  ({len(files)} shards, {wbytes / GB:.3f} GB of weights; "
          f"page cache warmed in {time.perf_counter() - t0:.2f}s)")
    print(f"host: {os.cpu_count()} CPUs; each case runs in a fresh process; repeats per case: {args.repeat}\n",
          flush=True)

    results: dict[str, list[dict[str, Any]]] = {}
    all_runs: dict[str, list[list[dict[str, Any]]]] = {}
    for case in cases:
        runs = []
        for _ in range(args.repeat):
            runs.append(run_case(case, model_dir, args.profile and case.startswith("ours")))
        results[case] = median_run(runs)
        all_runs[case] = runs
        for r in results[case]:
            if "profile" in r:
                print(f"===== cProfile: {case} rank {r['rank']} (cumulative) =====\n{r['profile']}")
                print(f"===== cProfile: {case} rank {r['rank']} (tottime) =====\n{r['profile_tottime']}")
        print(f"  {case}: " + ", ".join(f"{r['seconds']:.3f}s" for r in results[case])
              + (f"  (all runs: {[round(max(x['seconds'] for x in run), 3) for run in runs]})" if args.repeat > 1 else ""),
              flush=True)

    best = {case: min(max(x["seconds"] for x in run) for run in all_runs[case]) for case in results}
    header = (f"{'case':<16}{'rank':>5}{'seconds':>9}{'best s':>8}{'GB/s':>8}{'weights GB':>11}{'peak +RSS GB':>13}"
              f"{'peak/wts':>9}{'rchar GB':>9}{'minflt':>9}{'majflt':>7}")
    print("\n" + header)
    print("-" * len(header))
    for case, rows in results.items():
        for r in rows:
            # Throughput and the memory ratio are against the bytes this process holds:
            # the whole checkpoint, or this rank's shard at TP=2.
            held = r["param_bytes"] if case == "ours-tp2" else wbytes
            rank = str(r["rank"]) if case == "ours-tp2" else "-"
            print(f"{case:<16}{rank:>5}{r['seconds']:>9.3f}{best[case]:>8.3f}{held / GB / r['seconds']:>8.2f}{held / GB:>11.3f}"
                  f"{r['peak_growth'] / GB:>13.3f}{r['peak_growth'] / held:>9.2f}{r['rchar'] / GB:>9.3f}"
                  f"{r['minflt']:>9}{r['majflt']:>7}")
    print("(peak +RSS: VmHWM high-water mark minus RSS before the load; 1 ms sampler cross-check: "
          + ", ".join(f"{c}={max(r['sampled_peak_growth'] for r in rows) / GB:.2f}" for c, rows in results.items())
          + " GB)")
    print("(rchar counts read()/pread() bytes only; pages reached through mmap show up as page faults instead)")

    def secs(case: str) -> float | None:
        return max(r["seconds"] for r in results[case]) if case in results else None

    print("\ntargets (median run; PASS/MISS is judged on the median)")
    verdicts = []

    def verdict(label: str, value: float, target: float, higher_is_better: bool, fmt: str,
                best_value: float | None = None) -> None:
        ok = value >= target if higher_is_better else value <= target
        verdicts.append(ok)
        sign = ">=" if higher_is_better else "<="
        alt = f"  [best-of-runs: {fmt.format(best_value)}]" if best_value is not None else ""
        print(f"  {label:<52} {fmt.format(value):>7}  (target {sign} {fmt.format(target)})  "
              f"{'PASS' if ok else 'MISS'}{alt}")

    ours_cases = [c for c in ("ours", "ours-lazy", "ours-eager", "ours-prefetch") if c in results]
    for case in ours_cases:
        if secs("transformers"):
            verdict(f"{case}: speed vs transformers", secs("transformers") / secs(case), TARGET_SPEEDUP_VS_HF, True,
                    "{:.2f}x", best["transformers"] / best[case])
        if secs("plain-read"):
            verdict(f"{case}: rate vs plain read", secs("plain-read") / secs(case), TARGET_FRACTION_OF_PLAIN_READ,
                    True, "{:.0%}", best["plain-read"] / best[case])
        verdict(f"{case}: peak RSS growth / weight bytes", results[case][0]["peak_growth"] / wbytes,
                TARGET_PEAK_RATIO, False, "{:.2f}x")
    if "ours-tp2" in results:
        for r in results["ours-tp2"]:
            verdict(f"ours-tp2 rank {r['rank']}: peak RSS growth / rank's weight bytes",
                    r["peak_growth"] / r["param_bytes"], TARGET_PEAK_RATIO, False, "{:.2f}x")
    if "safetensors" in results and "ours" in results:
        print(f"  (for reference: ours vs safetensors.load_file: {secs('safetensors') / secs('ours'):.2f}x)")
    print(f"\n{sum(verdicts)}/{len(verdicts)} targets met")


if __name__ == "__main__":
    main()
