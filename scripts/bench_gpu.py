"""Our engine on one GPU against transformers' `generate` and against the card's own
limits, measured in the same run (issue 35's targets).

    python scripts/bench_gpu.py                              # H200: about 3-4 minutes
    python scripts/bench_gpu.py --device cpu --shape tiny    # the script's logic on a CPU

1. limits   the card's device-to-device copy bandwidth (a --copy-mib buffer copy_'d,
            read + write bytes over seconds) and its bf16 matmul rate (--matmul-size cubed).
2. For each --shape (Llama-3.2-1B and Llama-3.1-8B shaped, random bfloat16 weights
   written to a temporary directory in seconds: bench_gpu_model.py), one fresh process
   (bench_gpu_child.py) starts our engine (its time to ready, weights from the page
   cache, CUDA graphs captured), loads transformers' model of the same checkpoint, and
   alternates the two over --rounds rounds: decode at each --batch-sizes (fixed prompt
   and output lengths, EOS ignored, greedy) and prefill (--prefill-seqs prompts of
   --prefill-len tokens).
3. ready    a second start of each shape in a fresh process (Triton's kernel cache now
            warm, as at any start after the first on a machine).
4. eager    batch-1 decode of the first shape with enforce_eager=True (CUDA graphs off).

Every figure is printed with the memory it ran in, then one TARGET line per target:
batch-1 decode of the 1B shape as a share of the copy-bandwidth roofline (bytes of weights
and K/V one step reads, over the measured bandwidth: >= 50%), batch-32 decode ours /
transformers (>= 5x), the 8B shape's 2k-token prefill as a share of the measured matmul
rate (2 x parameters x tokens FLOPs: >= 50%), and the 8B shape's time to ready (< 15 s).
On the CPU (--device cpu --shape tiny) every step runs and prints, and no target is
judged. Each phase runs within what is left of --time-budget; a phase cut short still
reports what it measured. Not a test: a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_common import RESULT_PREFIX, comma_list, load_average  # noqa: E402
from bench_gpu_child import add_child_args, child_main  # noqa: E402
from bench_gpu_model import SHAPES, decode_bytes_per_step, mean_decode_context, prefill_flops, \
    write_random_checkpoint  # noqa: E402

PHASES = ["limits", "decode", "prefill", "transformers", "ready", "eager"]
GiB = 1 << 30
MIN_CHILD_S = 15.0  # a child given less than this is not started
# The targets: (metric, shape) -> (threshold, higher is better).
TARGETS = {("decode1", "1b"): (50.0, True), ("decode32", "1b"): (5.0, True), ("prefill", "8b"): (50.0, True),
           ("ready", "8b"): (15.0, False)}
DEFAULTS = {  # per device: what fits the time budget there
    "cuda": dict(copy_mib=2048, matmul_size=8192, decode_prompt_len=128, decode_tokens=128, prefill_len=2048,
                 prefill_seqs=8, max_num_batched_tokens=8192),
    "cpu": dict(copy_mib=64, matmul_size=256, decode_prompt_len=16, decode_tokens=8, prefill_len=64,
                prefill_seqs=2, max_num_batched_tokens=512),
}


# --------------------------------------------------------------------------- the card's limits


def measure_limits(device: str, copy_mib: int, matmul_size: int, iters: int = 20) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, each the
    best of `iters` timed runs after a warm-up, measured in this process; frees its buffers."""
    import torch

    def best_seconds(fn: Any) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(iters):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    src = torch.ones(copy_mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda src=src, dst=dst: dst.copy_(src))  # bound now: both are deleted below
    del src, dst
    a = torch.randn(matmul_size, matmul_size, device=device).to(torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    matmul_s = best_seconds(lambda a=a, b=b, c=c: torch.mm(a, b, out=c))
    del a, b, c
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bytes_s": 2 * (copy_mib << 20) / copy_s, "matmul_flop_s": 2 * matmul_size ** 3 / matmul_s}


# --------------------------------------------------------------------------- running the children


def run_child(args: argparse.Namespace, shape: str, model: Path, timeout: float, *flags: str,
              batch_sizes: list[int] | None = None) -> list[dict[str, Any]]:
    """One measuring process (bench_gpu_child.py); its RESULT records, also those it
    printed before it failed or ran out of `timeout` (then killed; the failure is printed)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", str(model), "--shape-name", shape,
           "--vocab-size", str(SHAPES[shape].vocab_size), "--max-model-len", str(args.max_model_len),
           "--device", args.device, "--batch-sizes", ",".join(map(str, batch_sizes or args.batch_sizes)),
           "--decode-prompt-len", str(args.decode_prompt_len), "--decode-tokens", str(args.decode_tokens),
           "--prefill-len", str(args.prefill_len), "--prefill-seqs", str(args.prefill_seqs),
           "--rounds", str(args.rounds), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), *flags]
    print(f"[{time.strftime('%H:%M:%S')}] {shape}: {' '.join(flags) or 'run'} (timeout {timeout:.0f}s)", flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, cwd=HERE.parent)
        out, failure = proc.stdout, (f"exit {proc.returncode}" if proc.returncode else None)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        failure = f"killed after its {timeout:.0f}s timeout"
    records = [json.loads(line[len(RESULT_PREFIX):]) for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
    for line in out.splitlines():
        if not line.startswith(RESULT_PREFIX):
            print(f"  {shape} | {line}")
    for r in records:
        print(f"  {shape} | {r['engine']} {r['what']}" + (f" batch {r['batch']}" if "batch" in r else "")
              + (f": {r['tok_s']:.0f} tok/s" if "tok_s" in r else f": {r['seconds']:.2f} s"), flush=True)
    if failure:
        print(f"  {shape} | FAILED ({failure}) after {len(records)} figures", flush=True)
    return records


def run_all(args: argparse.Namespace, root: Path) -> tuple[dict[str, float] | None, list[dict[str, Any]]]:
    start = time.perf_counter()

    def left() -> float:
        return args.time_budget - (time.perf_counter() - start)

    limits = None
    if "limits" in args.phases:
        limits = measure_limits(args.device, args.copy_mib, args.matmul_size)
        print(f"card limits: copy {limits['copy_bytes_s'] / 1e9:.0f} GB/s (read + write of a {args.copy_mib} MiB "
              f"buffer), bf16 matmul {args.matmul_size}^3 {limits['matmul_flop_s'] / 1e12:.1f} TFLOP/s", flush=True)
    records: list[dict[str, Any]] = []
    models: dict[str, Path] = {}
    flags = [f"--{phase}" for phase in ("decode", "prefill", "transformers") if phase in args.phases]
    if "decode" not in args.phases and "prefill" not in args.phases:
        flags = ["--ready-only"]
    for shape in args.shape:
        if left() < MIN_CHILD_S:
            print(f"{shape}: skipped (time budget)")
            continue
        t0 = time.perf_counter()
        models[shape] = write_random_checkpoint(SHAPES[shape], root / shape, "cuda" if args.device == "cuda" else "cpu")
        print(f"{shape}: {SHAPES[shape].name}-shaped random checkpoint written in {time.perf_counter() - t0:.1f}s",
              flush=True)
        records += run_child(args, shape, models[shape], left(), *flags)
    # Most wanted first, where the budget runs short: the last (largest) shape's second
    # start, the graphs-off line, then the other shapes' second starts.
    second_starts = [(s, ("--ready-only", "--second-start"), None) for s in reversed(args.shape)
                     if "ready" in args.phases]
    eager = [(args.shape[0], ("--enforce-eager", "--decode"), [1])] if "eager" in args.phases else []
    later = second_starts[:1] + eager + second_starts[1:]
    for shape, child_flags, batch_sizes in later:
        if shape in models and left() >= MIN_CHILD_S:
            records += run_child(args, shape, models[shape], left(), *child_flags, batch_sizes=batch_sizes)
        else:
            print(f"{shape} {' '.join(child_flags)}: skipped ({'time budget' if shape in models else 'no model'})")
    return limits, records


# --------------------------------------------------------------------------- the report


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.1f}"


def mem_text(mem: dict[str, int]) -> str:
    if "rss" in mem:
        return f"rss {gib(mem['rss'])} GiB"
    return f"peak alloc {gib(mem['peak_allocated'])} GiB, device used {gib(mem['device_used'])} GiB"


ENGINE_ORDER = ["ours", "ours (eager)", "transformers"]
WHAT_ORDER = ["ready", "decode", "prefill"]


def summarize(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per (shape, engine, what, batch, second start): the median rate (tok/s, or seconds
    for a start) and step time over its rounds, the per-round values, the largest memory
    figures among its rounds, and its first record (the start's details)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        key = (r["shape"], r["engine"], r["what"], r.get("batch"), r.get("first_start") is False)
        groups.setdefault(key, []).append(r)
    out = {}
    for key, rs in groups.items():
        unit = "tok_s" if "tok_s" in rs[0] else "seconds"
        out[key] = {"value": statistics.median(r[unit] for r in rs), "unit": unit, "per_round": [r[unit] for r in rs],
                    "step_ms": statistics.median(r["step_ms"] for r in rs) if "step_ms" in rs[0] else None,
                    "mem": {k: max(r["mem"][k] for r in rs) for k in rs[0]["mem"]}, "first": rs[0]}
    return out


def print_table(args: argparse.Namespace, summary: dict[tuple, dict[str, Any]]) -> None:
    print(f"\n{'shape':<6}{'engine':<14}{'measurement':<19}{'figure':>26}  memory (the largest of its rounds)")
    order = {s: i for i, s in enumerate(args.shape)}
    for key in sorted(summary, key=lambda k: (order[k[0]], ENGINE_ORDER.index(k[1]), WHAT_ORDER.index(k[2]),
                                              k[3] or 0, k[4])):
        shape, engine, what, batch, second = key
        s, first = summary[key], summary[key]["first"]
        label = {"ready": "load" if engine == "transformers" else ("ready, 2nd start" if second else "ready"),
                 "decode": f"decode batch {batch}", "prefill": f"prefill {batch} seqs"}[what]
        figure = f"{s['value']:.2f} s" if s["unit"] == "seconds" else f"{s['value']:.0f} tok/s"
        if s["step_ms"] is not None:
            figure += f" ({s['step_ms']:.2f} ms/step)"
        extra = ""
        if "kv_cache_bytes" in first:
            graphs = first["cuda_graph_sizes"]
            extra = (f" | {first['attention_backend']}, CUDA graphs "
                     + (f"{graphs[0]}..{graphs[-1]} ({len(graphs)} sizes)" if graphs else "off")
                     + f"; weights {gib(first['weights_bytes'])} GiB, KV cache {gib(first['kv_cache_bytes'])} GiB; "
                     + ", ".join(f"{k} {v:.2f}s" for k, v in first["timings"].items()))
        print(f"{shape:<6}{engine:<14}{label:<19}{figure:>26}  {mem_text(s['mem'])}{extra}")


def verdict(metric: str, shape: str, value: float | None, device: str) -> str:
    if value is None:
        return "not measured"
    if (metric, shape) not in TARGETS:
        return "(for information)"
    threshold, higher = TARGETS[(metric, shape)]
    target = f"target {'>=' if higher else '<'} {threshold:g}{'' if metric == 'ready' else ('x' if metric == 'decode32' else '%')}"
    if device != "cuda":
        return f"[{target}] not judged (not a GPU run)"
    met = value >= threshold if higher else value < threshold
    return f"[{target}] {'PASS' if met else 'MISS'}"


def print_targets(args: argparse.Namespace, limits: dict[str, float] | None, summary: dict[tuple, dict]) -> None:
    def rate(shape: str, engine: str, what: str, batch: int | None, second: bool = False) -> float | None:
        s = summary.get((shape, engine, what, batch, second))
        return None if s is None else s["value"]

    print()
    big = max(args.batch_sizes)
    for shape in args.shape:
        model = SHAPES[shape]
        ours1 = rate(shape, "ours", "decode", 1)
        if ours1 is not None and limits is not None:
            step_bytes = decode_bytes_per_step(model, 1, round(mean_decode_context(args.decode_prompt_len,
                                                                                   args.decode_tokens)))
            roofline = limits["copy_bytes_s"] / step_bytes
            pct = 100 * ours1 / roofline
            print(f"TARGET batch-1 decode, {model.name}: {ours1:.0f} tok/s = {pct:.1f}% of the copy roofline "
                  f"({roofline:.0f} tok/s: {step_bytes / 1e9:.3f} GB per step at {limits['copy_bytes_s'] / 1e9:.0f} "
                  f"GB/s) {verdict('decode1', shape, pct, args.device)}")
        else:
            print(f"TARGET batch-1 decode, {model.name}: {verdict('decode1', shape, None, args.device)}")
        eager = rate(shape, "ours (eager)", "decode", 1)
        if eager is not None and ours1 is not None:
            print(f"INFO batch-1 decode, {model.name}, enforce_eager=True (CUDA graphs off): {eager:.0f} tok/s; "
                  f"graphs on {ours1:.0f} tok/s = {ours1 / eager:.2f}x")
        ours_big = summary.get((shape, "ours", "decode", big, False))
        hf_big = summary.get((shape, "transformers", "decode", big, False))
        if ours_big and hf_big:
            ratios = [a / b for a, b in zip(ours_big["per_round"], hf_big["per_round"])]
            ratio = statistics.median(ratios)
            print(f"TARGET batch-{big} decode, {model.name}: ours / transformers = {ratio:.2f}x ({ours_big['value']:.0f}"
                  f" against {hf_big['value']:.0f} tok/s; per round {', '.join(f'{x:.2f}' for x in ratios)}) "
                  f"{verdict('decode32', shape, ratio, args.device)}")
        else:
            print(f"TARGET batch-{big} decode, {model.name}: ours / transformers {verdict('decode32', shape, None, args.device)}")
        prefill = rate(shape, "ours", "prefill", args.prefill_seqs)
        if prefill is not None and limits is not None:
            per_token = prefill_flops(model, args.prefill_seqs, args.prefill_len) / (args.prefill_seqs * args.prefill_len)
            pct = 100 * prefill * per_token / limits["matmul_flop_s"]
            print(f"TARGET {args.prefill_len}-token prefill, {model.name}: {prefill:.0f} tok/s = "
                  f"{prefill * per_token / 1e12:.1f} TFLOP/s = {pct:.1f}% of the bf16 matmul rate "
                  f"({limits['matmul_flop_s'] / 1e12:.0f} TFLOP/s) {verdict('prefill', shape, pct, args.device)}")
        else:
            print(f"TARGET {args.prefill_len}-token prefill, {model.name}: {verdict('prefill', shape, None, args.device)}")
        first, second = rate(shape, "ours", "ready", None), rate(shape, "ours", "ready", None, True)
        ready = second if second is not None else first
        detail = "" if ready is None else f"{ready:.2f} s ({'second' if second is not None else 'first'} start"
        if second is not None and first is not None:
            detail += f"; the first, Triton's kernel cache cold: {first:.2f} s"
        print(f"TARGET time to ready, {model.name}: {detail}{') ' if detail else ''}"
              f"{verdict('ready', shape, ready, args.device)}")


# --------------------------------------------------------------------------- main


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where there is one")
    p.add_argument("--shape", default="1b,8b", help=f"comma-separated, of {sorted(SHAPES)} (default 1b,8b)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {PHASES} (default: all)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32], help="decode batches (default 1,32)")
    p.add_argument("--rounds", type=int, default=3)
    for name in DEFAULTS["cuda"]:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {DEFAULTS['cuda'][name]} on cuda, {DEFAULTS['cpu'][name]} on cpu")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45,
                   help="ours' share of the GPU (transformers runs in the rest; default 0.45)")
    p.add_argument("--time-budget", type=float, default=280.0, help="seconds for the whole run (default 280)")
    p.add_argument("--model-root", default=None, help="where the checkpoints go (default: a temporary directory)")
    add_child_args(p)
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.child:
        child_main(args)
        return
    args.shape = comma_list(p, args.shape, sorted(SHAPES), "shape")
    args.phases = comma_list(p, args.phases, PHASES, "phase")
    args.max_model_len = -(-max(args.prefill_len + 1, args.decode_prompt_len + args.decode_tokens) // 256) * 256

    import torch

    gpu = (f"{torch.cuda.get_device_name()}, {torch.cuda.mem_get_info()[1] / GiB:.1f} GiB"
           if args.device == "cuda" else f"{os.cpu_count()} CPUs")
    print(f"bench_gpu: device={args.device} ({gpu}), torch {torch.__version__}, python {sys.version.split()[0]}, "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {load_average()}")
    print(f"shapes {args.shape}, phases {args.phases}; decode batches {args.batch_sizes}: "
          f"{args.decode_prompt_len}-token prompts, {args.decode_tokens} new tokens; prefill {args.prefill_seqs} x "
          f"{args.prefill_len} tokens; {args.rounds} rounds; max_model_len {args.max_model_len}", flush=True)
    root = Path(args.model_root) if args.model_root else Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    wall = time.perf_counter()
    try:
        limits, records = run_all(args, root)
    finally:
        if args.model_root is None:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(records)
    print_table(args, summary)
    print_targets(args, limits, summary)
    print(f"\nwall time {time.perf_counter() - wall:.0f}s")


if __name__ == "__main__":
    main()
