#!/usr/bin/env python3
"""Benchmark: every load format / strategy against the default `lazy` safetensors load.

Generates (once, cached under --dir) a ~0.5 GB bfloat16 llama checkpoint with
scripts/bench_common.py's `ensure_checkpoint`, plus a `.bin` copy, its npcache, and a
TP=2 `sharded_state` copy. Each case then loads the model with `get_model()` in a fresh
process (two processes for the TP=2 cases) and is timed exactly like bench_load.py:
from just before the load until one byte of every page of every parameter is resident.

Cases (TP=1 unless named -tp2):
  lazy / eager / prefetch   safetensors_load_strategy
  mt-safetensors            model_loader_extra_config enable_multithread_load, --threads
  pt / mt-pt                the `.bin` copy, torch.load(weights_only, mmap) / threaded
  npcache                   the numpy cache of the `.bin` copy (already built)
  dummy                     random weights, no file read (a floor for "building the model")
  safetensors-tp2 / sharded_state-tp2   two gloo ranks; per-rank numbers, slowest rank counts
  sharded_state-tp2-prefetch            the same with safetensors_load_strategy="prefetch"

Page cache: "warm" reads every file of the case first. "cold" evicts the case's files
from the page cache with posix_fadvise(POSIX_FADV_DONTNEED) first (a per-file eviction
that needs no privileges and leaves the rest of the machine alone); --drop-caches
instead writes 1 to /proc/sys/vm/drop_caches (root only; it disturbs every process on
the host). The report prints which mode was used and whether eviction worked (bytes
read from the block device, majflt).

The npcache build (the one-off conversion) is timed separately and printed.
This script is never part of the test suite.

Usage: python scripts/bench_loaders.py [--dir .bench/loaders] [--modes warm,cold] [--repeat N]
       [--cases lazy,eager,...] [--threads 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

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
    print_result,
    run_children,
    touch_all,
    warm_page_cache,
    weight_bytes,
)

SPEC: dict[str, Any] = dict(  # ~0.49 GB of bf16 weights
    arch="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=4, vocab_size=32000, num_shards=4, dtype="bfloat16", max_position_embeddings=2048,
)
QUICK_SPEC: dict[str, Any] = dict(SPEC, num_hidden_layers=4, vocab_size=16000, num_shards=2)  # ~0.13 GB
SINGLE_CASES = ["lazy", "eager", "prefetch", "mt-safetensors", "pt", "mt-pt", "npcache", "dummy"]
TP2_CASES = ["safetensors-tp2", "sharded_state-tp2", "sharded_state-tp2-prefetch"]
ALL_CASES = [*SINGLE_CASES, *TP2_CASES]


# --------------------------------------------------------------------------- checkpoints


def ensure_bin_copy(model_dir: Path) -> Path:
    """`<model>-bin`: one pytorch_model-*.bin per safetensors shard, same tensors."""
    out = model_dir.with_name(model_dir.name + "-bin")
    marker = out / "bench_done"
    if marker.is_file():
        return out
    import torch
    from safetensors.torch import load_file

    print(f"writing {out} ...", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copyfile(model_dir / "config.json", out / "config.json")
    shards = sorted(model_dir.glob("*.safetensors"))
    for i, f in enumerate(shards):
        torch.save(load_file(str(f)), out / f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin")
    marker.write_text("ok")
    return out


def build_npcache(bin_dir: Path) -> float:
    """Build (or rebuild) the npcache of `bin_dir`; returns the conversion time."""
    from model_loader.npcache import ensure_np_cache, np_cache_dir
    from model_loader.weight_files import prepare_weight_files

    cache = np_cache_dir(bin_dir, None)
    if (cache / "manifest.json").is_file():
        return -1.0
    files, _ = prepare_weight_files(bin_dir, "npcache", [])
    t0 = time.perf_counter()
    ensure_np_cache(files, cache)
    return time.perf_counter() - t0


def ensure_sharded_copy(model_dir: Path) -> Path:
    out = model_dir.with_name(model_dir.name + "-sharded-tp2")
    if (out / "bench_done").is_file():
        return out
    print(f"writing {out} (scripts/save_sharded_state.py --tp 2) ...", flush=True)
    from save_sharded_state import main as save_main

    save_main([str(model_dir), str(out), "--tp", "2", "--device", "cpu", "--max-model-len", "64"])
    (out / "bench_done").write_text("ok")
    return out


def case_files(case: str, dirs: dict[str, Path]) -> list[Path]:
    """The files a case reads (for warming / evicting the page cache)."""
    if case in ("pt", "mt-pt"):
        return sorted(dirs["bin"].glob("*.bin"))
    if case == "npcache":
        return sorted((dirs["bin"] / "np").glob("*.npy"))
    if case.startswith("sharded_state-tp2"):
        return sorted(dirs["sharded"].glob("model-rank-*.safetensors"))
    if case == "dummy":
        return []
    return sorted(dirs["model"].glob("*.safetensors"))


def evict(files: list[Path], drop_caches: bool) -> str:
    if drop_caches:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


# --------------------------------------------------------------------------- child


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    case = args.child
    dirs: dict[str, Any] = {k: Path(v) for k, v in json.loads(args.dirs).items()}
    dirs = {k: dirs.get(k, "<not prepared>") for k in ("model", "bin", "sharded")}
    import model_loader.default_loader  # noqa: F401  (imports outside the clock)
    import model_loader.dummy_loader  # noqa: F401
    import model_loader.multithread  # noqa: F401
    import model_loader.npcache  # noqa: F401
    import model_loader.sharded_state_loader  # noqa: F401
    import models.llama  # noqa: F401
    from engine.arg_utils import create_engine_config
    from model_loader import get_model

    mt = {"enable_multithread_load": True, "num_threads": args.threads}
    kwargs: dict[str, Any] = {
        "lazy": dict(model=dirs["model"], safetensors_load_strategy="lazy"),
        "eager": dict(model=dirs["model"], safetensors_load_strategy="eager"),
        "prefetch": dict(model=dirs["model"], safetensors_load_strategy="prefetch"),
        "mt-safetensors": dict(model=dirs["model"], model_loader_extra_config=mt),
        "pt": dict(model=dirs["bin"], load_format="pt"),
        "mt-pt": dict(model=dirs["bin"], load_format="pt", model_loader_extra_config=mt),
        "npcache": dict(model=dirs["bin"], load_format="npcache"),
        "dummy": dict(model=dirs["model"], load_format="dummy"),
        "safetensors-tp2": dict(model=dirs["model"], safetensors_load_strategy="lazy"),
        "sharded_state-tp2": dict(model=dirs["sharded"], load_format="sharded_state"),
        "sharded_state-tp2-prefetch": dict(model=dirs["sharded"], load_format="sharded_state",
                                           safetensors_load_strategy="prefetch"),
    }[case]
    kwargs["model"] = str(kwargs["model"])
    tp = 1
    if "-tp2" in case:
        torch.set_num_threads(1)
        tp = 2
        join_tp_group(args.rank, tp, args.port)
    config = create_engine_config(device="cpu", tensor_parallel_size=tp, use_tqdm_on_load=False, **kwargs)
    with Meter() as meter:
        tensors = list(get_model(config).parameters())
        touch_all(tensors)
    result = dict(meter.result, case=case, rank=args.rank, param_bytes=param_bytes(tensors))
    if tp > 1:
        leave_tp_group()
    return result


def _child_cmd(case: str, dirs: dict[str, Path], threads: int, rank: int = 0, port: int = 0) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", case,
            "--dirs", json.dumps({k: str(v) for k, v in dirs.items()}), "--threads", str(threads),
            "--rank", str(rank), "--port", str(port)]


def run_case(case: str, dirs: dict[str, Path], threads: int, timeout: float = 900) -> list[dict[str, Any]]:
    env = child_env()
    if "-tp2" not in case:
        return run_children([_child_cmd(case, dirs, threads)], case, env, timeout)
    port = free_port()
    return run_children([_child_cmd(case, dirs, threads, rank, port) for rank in range(2)], case, env, timeout)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=str(REPO / ".bench" / "loaders"), help="checkpoint cache directory")
    p.add_argument("--quick", action="store_true", help="a ~0.13 GB model instead of ~0.5 GB")
    p.add_argument("--repeat", type=int, default=1, help="runs per case and mode (median reported)")
    p.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma-separated subset of {ALL_CASES}")
    p.add_argument("--modes", default="warm,cold", help="warm and/or cold page cache")
    p.add_argument("--threads", type=int, default=8, help="num_threads of the multi-thread cases")
    p.add_argument("--drop-caches", action="store_true", help="cold = /proc/sys/vm/drop_caches (root; host-wide)")
    add_child_args(p)
    p.add_argument("--dirs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        print_result(run_child(args))
        return

    cases = comma_list(p, args.cases, ALL_CASES, "case")
    modes = comma_list(p, args.modes, ["warm", "cold"], "mode")

    model_dir = ensure_checkpoint(Path(args.dir), QUICK_SPEC if args.quick else SPEC)
    dirs = {"model": model_dir}
    if {"pt", "mt-pt", "npcache"} & set(cases):
        dirs["bin"] = ensure_bin_copy(model_dir)
    if "npcache" in cases:
        built = build_npcache(dirs["bin"])
        if built >= 0:
            print(f"npcache build (one-off .bin -> numpy conversion): {built:.2f}s", flush=True)
    if {"sharded_state-tp2", "sharded_state-tp2-prefetch"} & set(cases):
        dirs["sharded"] = ensure_sharded_copy(model_dir)
    wbytes = weight_bytes(model_dir)
    print(f"model: {model_dir} ({wbytes / GB:.3f} GB of bf16 weights); host: {os.cpu_count()} CPUs; "
          f"threads for mt cases: {args.threads}; repeats: {args.repeat}", flush=True)

    cold_method = None
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for mode in modes:
        for case in cases:
            runs = []
            for _ in range(args.repeat):
                files = case_files(case, dirs)
                if mode == "warm":
                    warm_page_cache(files)
                else:
                    try:
                        cold_method = evict(files, args.drop_caches)
                    except OSError as e:
                        print(f"  cannot evict the page cache ({e}); skipping cold mode", flush=True)
                        break
                runs.append(run_case(case, dirs, args.threads))
            if runs:
                results[(mode, case)] = median_run(runs)
                r = results[(mode, case)]
                print(f"  {mode:<5} {case:<18} " + ", ".join(f"{x['seconds']:.3f}s" for x in r)
                      + f"  (read from disk: {sum(x['read_bytes'] for x in r) / GB:.2f} GB, "
                      f"majflt {sum(x['majflt'] for x in r)})", flush=True)

    def secs(mode: str, case: str) -> float | None:
        r = results.get((mode, case))
        return max(x["seconds"] for x in r) if r else None

    header = (f"{'mode':<6}{'case':<28}{'seconds':>9}{'GB/s':>8}{'vs lazy':>9}{'peak +RSS GB':>13}"
              f"{'disk GB':>9}{'majflt':>8}")
    print("\n" + header + "\n" + "-" * len(header))
    for (mode, case), rows in results.items():
        s = max(x["seconds"] for x in rows)
        base = secs(mode, "safetensors-tp2" if "-tp2" in case else "lazy")
        ratio = f"{base / s:.2f}x" if base else "-"
        held = wbytes
        print(f"{mode:<6}{case:<28}{s:>9.3f}{held / GB / s:>8.2f}{ratio:>9}"
              f"{max(x['peak_growth'] for x in rows) / GB:>13.3f}{sum(x['read_bytes'] for x in rows) / GB:>9.2f}"
              f"{sum(x['majflt'] for x in rows):>8}")
    print("(vs lazy: lazy seconds / case seconds, >1 is faster; TP=2 cases compare with safetensors-tp2; "
          "GB/s: whole-checkpoint bytes / seconds)")
    if cold_method:
        print(f"cold = page cache evicted with {cold_method}"
              + ("" if args.drop_caches else " (per-file posix_fadvise DONTNEED; /proc/sys/vm/drop_caches not used)"))

    print("\nwinners")
    for mode in modes:
        file_cases = [c for c in SINGLE_CASES if c != "dummy" and (mode, c) in results]
        if file_cases:
            best = min(file_cases, key=lambda c: secs(mode, c))
            lazy = secs(mode, "lazy")
            rel = f" ({lazy / secs(mode, best):.2f}x lazy)" if lazy else ""
            print(f"  {mode}, TP=1: {best} {secs(mode, best):.3f}s{rel}; ranking: "
                  + " < ".join(f"{c} {secs(mode, c):.2f}s" for c in sorted(file_cases, key=lambda c: secs(mode, c))))
        st2 = secs(mode, "safetensors-tp2")
        for case in ("sharded_state-tp2", "sharded_state-tp2-prefetch"):
            sh2 = secs(mode, case)
            if st2 and sh2:
                print(f"  {mode}, TP=2: {case} {sh2:.3f}s vs safetensors-tp2 {st2:.3f}s -> "
                      f"{case if sh2 < st2 else 'safetensors-tp2'} wins ({st2 / sh2:.2f}x)")


if __name__ == "__main__":
    main()
