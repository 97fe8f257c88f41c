"""Ours against llama.cpp on the same GGUF files (issue 37, item 5).

The files: a random-weight 853M-parameter Llama (hidden 2048, 16 layers, 32 heads / 8
KV heads, FFN 5632, vocabulary 32000, untied LM head) stored as F16, Q8_0 and Q4_K_M,
written once and cached (scripts/bench_gguf_model.py: Q4_K_M by llama.cpp's own
quantiser from the peer's library). Per file, each side loads the file and runs the
same workload (bench_held.measure_decode): batch-1 decode of a 128-token prompt to
128 new tokens, greedy, EOS ignored, and 16 such requests at once; then, still holding
the model and its KV cache, its resident memory is read from /proc (VmRSS, RssAnon,
RssFile; ours: the process of every rank, the engine's own at TP=1; llama.cpp: its
process, whose RssFile counts the mmapped file), and again once each side has gone
idle as its server does and 2 s have passed (ours: `EngineCore.trim_host_memory`, what
engine.serve's loop does after a health-check interval without work, handing back
the heap pages the batch's activations freed; llama.cpp: nothing, its buffers are
fixed). Time to ready: from each side's
constructor call (our EngineCore, its KV cache committed; llama.cpp's server) until it
would take a request (llama.cpp: /health answers 200, its warm-up run done), its
package's import left out.

Ours: `EngineCore(model=<file.gguf>, device="cpu", dtype=--dtype)` (load_format gguf
from the suffix; the default `auto` is the file's own float16, what a user gets; the
runs before 2026-12-07 04:40 used bfloat16), prefix caching off, a KV cache of
llama.cpp's size. llama.cpp: its
server from ../shared/peers/llama-cpp/install.sh (scripts/bench_llamacpp_peer.py),
native /completion with token-id prompts, 16 slots, continuous batching. Both use the
cores this process may run on (two on the reference machine): ours binds its threads
to them (cpu_threads_bind auto), llama.cpp runs that many threads on them. The sides
strictly alternate and never overlap: start, measure, stop, then the other (llama.cpp's
spinning thread pool collapses when it shares a core). Each figure is the best of
--repeats.

The roofline is measured in the same run, before each file: a streaming read of a
buffer far larger than the last-level cache on the same threads (GB/s); roofline tok/s
= that bandwidth / the bytes one decode step must read (the file's tensors but the
embedding table, plus the mean KV cache read). Targets (issue 37): batch-1 >= llama.cpp
and >= 60% of the roofline; 16 concurrent >= 2x llama.cpp; resident <= 1.2x the file
(checked after the workload and idle).

    python scripts/bench_vs_llamacpp.py [--files F16,Q8_0,Q4_K_M] [--repeats 2] [--quick] [--moe]
        [--llamacpp-python ~/.cache/peers/llama-cpp/bin/python] [--dtype auto]

--moe: a random Qwen3-MoE instead (llama.cpp's qwen3moe; bench_moe.py's shape: hidden
1024, 8 layers, 16 experts of 768, top 4, 0.39B parameters), whose decode step reads the
used experts' share of the stacks (the roofline counts that).

--quick: a 6M-parameter model and 48 new tokens, a smoke run of every path in about a
minute. Without the peer's python: ours alone (and no Q4_K_M file). Not a test: timings
on a shared machine mean little.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_common import child_env, comma_list, load_average, print_result, run_children  # noqa: E402
from bench_gguf_model import (  # noqa: E402
    FILE_TYPES,
    FULL_SPEC,
    MOE_SPEC,
    QUICK_MOE_SPEC,
    QUICK_SPEC,
    bytes_read_per_token,
    ensure_gguf_files,
)
from bench_held import measure_decode, random_prompts, run_held_child, serve_held  # noqa: E402

DEFAULT_PEER_PYTHON = Path.home() / ".cache" / "peers" / "llama-cpp" / "bin" / "python"
PEER_SCRIPT = HERE / "bench_llamacpp_peer.py"
GiB = 2**30
CHILD_TIMEOUT_S = 1800
IDLE_S = 2.0  # after going idle, before the second reading of resident memory


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def make_workload(vocab: int, prompt_len: int, max_tokens: int, concurrency: int) -> dict:
    """bench_held.measure_decode's workload: the same prompts on both sides."""
    prompts = random_prompts(4 + concurrency, prompt_len, vocab)
    return {"prompts": prompts[:4], "concurrent_prompts": prompts[4:], "max_tokens": max_tokens}


# --------------------------------------------------------------------------- children


def child_ours(model: str, dtype: str, kv_bytes: int, concurrency: int, workload: dict, hold) -> None:
    """Our side in this process (bench_held.serve_held's `run`): held while the engine is up."""
    from engine import SamplingParams
    from engine.core import EngineCore

    start = time.perf_counter()
    with EngineCore(model=model, device="cpu", dtype=dtype, kv_cache_memory_bytes=kv_bytes, max_num_seqs=concurrency,
                    enable_prefix_caching=False, use_tqdm_on_load=False) as core:
        core.collective_rpc("wait_kv_cache_committed")  # committed in the background; settle it before the clock
        ready_s = time.perf_counter() - start

        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
            return [list(o.outputs[0].token_ids) for o in core.generate(prompts, params)]

        result = {**measure_decode(generate, workload), "ready_s": ready_s}
        # The ranks' processes (mp), or this one (uni at TP=1): where the weights live.
        processes = getattr(core.model_executor, "processes", None)
        result["rank_pids"] = [p.pid for p in processes] if processes else [os.getpid()]
        hold(result, idle=core.trim_host_memory)  # what engine.serve's loop does once idle an interval


def child_probe(mib: int, threads: int) -> dict:
    """Streaming-read bandwidth: the best of 5 sums of a `mib` MiB float32 buffer."""
    import time

    import torch

    torch.set_num_threads(threads)
    buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)  # written once: every page resident
    buffer.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return {"gb_s": buffer.numel() * 4 / best / 1e9}


# --------------------------------------------------------------------------- parent


def run_side(side: str, args: argparse.Namespace, path: Path, kv_bytes: int, ctx_per_slot: int,
             workload: dict) -> tuple[dict, dict[str, int]]:
    """One side alone on the machine: its result and its summed resident memory."""
    if side == "ours":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "ours", "--model", str(path),
               "--dtype", args.dtype, "--kv-bytes", str(kv_bytes), "--concurrency", str(args.concurrency)]
    else:
        cmd = [args.llamacpp_python, str(PEER_SCRIPT), "serve", "--model", str(path), "--threads", str(len(cores())),
               "--parallel", str(args.concurrency), "--ctx-per-slot", str(ctx_per_slot)]
    result, memory = run_held_child(cmd, workload, child_env(), CHILD_TIMEOUT_S, f"{side} on {path.name}",
                                    idle_s=IDLE_S)
    total = {key: sum(m[key] for m in memory.values())
             for key in ("rss", "anon", "file", "idle_rss", "idle_anon", "idle_file")}
    return result, total


def probe_bandwidth(mib: int) -> float:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "probe", "--probe-mib", str(mib)]
    return run_children([cmd], "bandwidth probe", child_env(), 600)[0]["gb_s"]


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fmt_gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def side_pair(figures: dict[str, str], ratio: float | None) -> str:
    """"llama.cpp / ours (ours/llama.cpp x)", or ours alone."""
    text = " / ".join(figures[s] for s in ("llama.cpp", "ours") if s in figures)
    return text + (f" ({ratio:.2f}x)" if ratio is not None else "")


def report(cells: dict, sides: list[str], concurrency: int) -> None:
    """The table with ratios, then each target met or not (issue 37's)."""
    both = "llama.cpp" in sides
    print(f"\n| file | size GiB | batch-1 decode tok/s, llama.cpp / ours | ours / roofline | {concurrency} concurrent "
          "tok/s, llama.cpp / ours | resident GiB (anon), llama.cpp / ours | ours / file | idle: resident GiB, "
          "llama.cpp / ours | idle: ours / file | time to ready s, llama.cpp / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, c in cells.items():
        best, mem = c["best"], c["memory"]
        rates = {key: side_pair({s: f"{best[s][key]:.1f}" for s in sides},
                                best["ours"][key] / best["llama.cpp"][key] if both else None)
                 for key in ("batch1_decode_tok_s", "concurrent_tok_s")}
        resident = side_pair({s: f"{fmt_gib(mem[s]['rss'])} ({fmt_gib(mem[s]['anon'])})" for s in sides}, None)
        idle = side_pair({s: f"{fmt_gib(mem[s]['idle_rss'])} ({fmt_gib(mem[s]['idle_anon'])})" for s in sides}, None)
        ready = side_pair({s: f"{c['ready_s'][s]:.2f}" for s in sides}, None)
        print(f"| {name} | {fmt_gib(c['file_bytes'])} | {rates['batch1_decode_tok_s']} | "
              f"{best['ours']['batch1_decode_tok_s'] / c['roofline_tok_s']:.0%} of {c['roofline_tok_s']:.1f} | "
              f"{rates['concurrent_tok_s']} | {resident} | {mem['ours']['rss'] / c['file_bytes']:.2f}x | {idle} | "
              f"{mem['ours']['idle_rss'] / c['file_bytes']:.2f}x | {ready} |")
    print("\nTargets (issue 37):")
    for name, c in cells.items():
        ours = c["best"]["ours"]
        checks = [("batch-1 >= 60% of roofline", ours["batch1_decode_tok_s"] >= 0.6 * c["roofline_tok_s"]),
                  ("resident <= 1.2x file", c["memory"]["ours"]["rss"] <= 1.2 * c["file_bytes"]),
                  ("idle, resident <= 1.2x file", c["memory"]["ours"]["idle_rss"] <= 1.2 * c["file_bytes"])]
        if both:
            peer = c["best"]["llama.cpp"]
            checks.insert(0, ("batch-1 >= llama.cpp", ours["batch1_decode_tok_s"] >= peer["batch1_decode_tok_s"]))
            checks.append((f"{concurrency} concurrent >= 2x llama.cpp",
                           ours["concurrent_tok_s"] >= 2 * peer["concurrent_tok_s"]))
        print(f"  {name}: " + "; ".join(f"{label}: {'met' if ok else 'NOT met'}" for label, ok in checks))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default=",".join(FILE_TYPES), help="comma-separated, of " + ", ".join(FILE_TYPES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a tiny model and 48 new tokens: a smoke run")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE (qwen3moe) file instead of the llama")
    p.add_argument("--llamacpp-python", default=str(DEFAULT_PEER_PYTHON) if DEFAULT_PEER_PYTHON.exists() else None,
                   help="the llama.cpp peer venv's python (default: %(default)s; none: ours alone)")
    p.add_argument("--dtype", default="auto",
                   help="our compute dtype (EngineConfig dtype); auto: what a user gets, float16 for these files")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench-gguf"))
    p.add_argument("--probe-mib", type=int, default=None, help="bandwidth probe buffer (default 2048, quick 256)")
    p.add_argument("--child", choices=["ours", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--kv-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child == "probe":
        print_result(child_probe(args.probe_mib, len(cores())))
        return
    if args.child == "ours":
        serve_held(lambda w, hold: child_ours(args.model, args.dtype, args.kv_bytes, args.concurrency, w, hold))
        return

    files = comma_list(p, args.files, list(FILE_TYPES), "file")
    sides = ["ours"] + (["llama.cpp"] if args.llamacpp_python else [])
    if not args.llamacpp_python and "Q4_K_M" in files:
        print("no llama.cpp peer: Q4_K_M (written by its quantiser) left out")
        files.remove("Q4_K_M")
    spec = (QUICK_MOE_SPEC if args.quick else MOE_SPEC) if args.moe else QUICK_SPEC if args.quick else FULL_SPEC
    prompt_len, max_tokens = (128, 48) if args.quick else (128, 128)
    probe_mib = args.probe_mib or (256 if args.quick else 2048)
    ctx_per_slot = -(-(prompt_len + max_tokens) // 256) * 256  # llama.cpp rounds a slot up to 256 positions
    kv_bytes = args.concurrency * ctx_per_slot * spec.kv_bytes_per_position()
    workload = make_workload(spec.vocab_size, prompt_len, max_tokens, args.concurrency)
    paths = ensure_gguf_files(Path(args.model_root), spec, files, args.llamacpp_python)
    print(f"{spec.num_params() / 1e6:.0f}M-parameter {spec.arch}; prompts {prompt_len}, {max_tokens} new tokens, greedy; "
          f"batch 1 and {args.concurrency} concurrent; cores {cores()}; ours dtype {args.dtype}; "
          f"KV cache {kv_bytes / 2**20:.0f} MiB each side; load average {load_average()}", flush=True)

    cells: dict = {}
    for name in files:
        path = paths[name]
        gb_s = probe_bandwidth(probe_mib)
        mean_context = prompt_len + max_tokens / 2
        step_bytes = bytes_read_per_token(path) + mean_context * spec.kv_bytes_per_position()
        cell = cells[name] = {"file_bytes": path.stat().st_size, "roofline_tok_s": gb_s * 1e9 / step_bytes,
                              "best": {}, "memory": {}, "tokens": {}, "ready_s": {}}
        print(f"{name}: {path.stat().st_size / GiB:.2f} GiB; streaming read {gb_s:.1f} GB/s; "
              f"{step_bytes / 1e9:.3f} GB a decode step -> roofline {cell['roofline_tok_s']:.1f} tok/s", flush=True)
        for rep in range(args.repeats):
            for side in sides:
                result, memory = run_side(side, args, path, kv_bytes, ctx_per_slot, workload)
                print(f"  run {rep + 1}: {side:9s} batch-1 decode {result['batch1_decode_tok_s']:7.1f} tok/s "
                      f"(prefill {result['prefill_s'] * 1e3:.0f} ms), {args.concurrency} concurrent "
                      f"{result['concurrent_tok_s']:7.1f} tok/s; resident {fmt_gib(memory['rss'])} GiB "
                      f"(anon {fmt_gib(memory['anon'])}, file {fmt_gib(memory['file'])}; idle "
                      f"{fmt_gib(memory['idle_rss'])}, anon {fmt_gib(memory['idle_anon'])}); "
                      f"ready in {result['ready_s']:.2f} s", flush=True)
                best = cell["best"].setdefault(side, {"batch1_decode_tok_s": 0.0, "concurrent_tok_s": 0.0})
                for key in best:
                    best[key] = max(best[key], result[key])
                cell["ready_s"][side] = min(cell["ready_s"].get(side, float("inf")), result["ready_s"])
                cell["memory"][side] = memory  # the last run's: it differs little between runs
                cell["tokens"][side] = result["batch1_tokens"]
        if len(sides) > 1:
            agree = leading_agreement(cell["tokens"]["ours"], cell["tokens"]["llama.cpp"])
            why = " (llama.cpp quantises activations on quantised files: they drift apart)" if name != "F16" else ""
            print(f"  greedy tokens agree for the first {agree} of {max_tokens}{why}")
    report(cells, sides, args.concurrency)


if __name__ == "__main__":
    main()
