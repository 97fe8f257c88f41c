"""TP=2 against TP=1 on this host, in steady state: ours alone, both engines kept up.

bench_vs_vllm.py times each configuration in a fresh process, first run included; here
one TP=1 engine and one TP=2 engine stay up in one process (the TP=1 one in-process, the
TP=2 one with its two WorkerProcs) and `generate()` alternates between them, round after
round, so the host's drift hits both alike and nothing first-time (page faults, oneDNN
primitives, the KV cache's commit) is measured. The workload is bench_vs_vllm.py's (32
requests, prompts of 32-128 tokens, 64 new tokens each, greedy, token ids only and only
the final outputs, as its generate() gets them), prefix caching off so that every round
prefills. Prints each round, each engine's median tok/s, prefill time and decode step,
and the median of the per-round ratios TP=2 / TP=1.

    python scripts/bench_tp_scaling.py [--dtypes float32 bfloat16] [--rounds 10] [--num-scheduler-steps 1 [8 ...]]
                                       [--tp 1 2 [4]] [--cores-per-rank N]

With --num-scheduler-steps N (multi-step decode) a decode step's time is its output's
over N. Several values run an engine pair for each, all alternating in every round,
and print, besides each TP=2 / TP=1, what each value buys at each TP over the first.

--tp picks the TP sizes (default 1 2; each TP=t / TP=1 is printed). --cores-per-rank N
gives every rank its own N cores (rank r of every engine: the allowed cores r*N ..
r*N+N-1, so the engines, which alternate, share them) and runs every engine, TP=1
included, with the multiprocess backend, so that the engine's own thread never sits on
a rank's cores: TP=2 then has twice TP=1's cores, and the goal printed is TP=2 >= 1.6x
TP=1 (a host with 16 cores: --tp 1 2 4 --cores-per-rank 4).

Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_serve import MODEL_SPEC, make_prompts  # noqa: E402
from bench_vs_vllm import KV_BYTES, MAX_TOKENS, NUM_REQUESTS, ensure_model  # noqa: E402


def steady_state_workload():
    """(prompts, params): bench_vs_vllm.py's 32 prompts and what its generate() asks for
    (greedy, 64 new tokens, final outputs only, token ids only)."""
    from engine import RequestOutputKind, SamplingParams

    prompts = make_prompts(NUM_REQUESTS, MODEL_SPEC["vocab_size"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    return prompts, params


SCALING_GOAL = 1.6  # TP=2 / TP=1 with --cores-per-rank (issue 35)


def steady_state_engine(model: Path, tp: int, dtype: str, num_scheduler_steps: int = 1, cores_per_rank: int = 0):
    """An EngineCore for that workload (bench_vs_vllm.py's KV cache and batch, prefix
    caching off so that every round prefills), returned once its KV cache is committed
    (so that the commit's page faults are in no round). With `cores_per_rank`, rank r is
    bound to the allowed cores r*N .. r*N+N-1 and TP=1 runs in a worker process too
    (see the module docstring). The caller shuts it down."""
    from engine.core import EngineCore
    from worker.cpu_affinity import allowed_cpus

    placement = {}
    if cores_per_rank:
        cpus = allowed_cpus()
        binds = [cpus[r * cores_per_rank:(r + 1) * cores_per_rank] for r in range(tp)]
        placement = dict(distributed_executor_backend="mp",
                         cpu_threads_bind="|".join(",".join(map(str, cores)) for cores in binds))
    core = EngineCore(model=str(model), tensor_parallel_size=tp, device="cpu", dtype=dtype,
                      kv_cache_memory_bytes=KV_BYTES, max_num_seqs=NUM_REQUESTS, use_tqdm_on_load=False,
                      enable_prefix_caching=False, num_scheduler_steps=num_scheduler_steps, **placement)
    try:
        core.collective_rpc("wait_kv_cache_committed")
    except BaseException:
        core.shutdown()
        raise
    return core


def timed_generate(core, prompts: list[list[int]], params) -> dict[str, float]:
    """One run of every prompt through `core`, step by step: total seconds, the prefill
    steps' seconds and the median decode step (a multi-step output's time over its
    number of steps)."""
    for prompt in prompts:
        core.add_request(prompt, params)
    steps: list[tuple[float, int]] = []  # (seconds per model step, tokens per model step)
    start = time.perf_counter()
    while core.has_unfinished_requests():
        step_start = time.perf_counter()
        core.step()
        num_steps = max(core.last_step_num_steps, 1)
        steps.append(((time.perf_counter() - step_start) / num_steps, core.last_step_num_tokens // num_steps))
    total = time.perf_counter() - start
    return {"total": total, "prefill": sum(t for t, n in steps if n > NUM_REQUESTS),
            "decode": statistics.median(t for t, n in steps if 0 < n <= NUM_REQUESTS)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1],
                   help="the engines' num_scheduler_steps (decode steps per schedule), both TPs alike; several "
                        "values: an engine pair for each")
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench"))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes, 1 among them (default 1 2)")
    p.add_argument("--cores-per-rank", type=int, default=0,
                   help="bind every rank to its own this many cores (default 0: cpu_threads_bind auto, TP=1 in-process)")
    args = p.parse_args()
    tps = sorted(set(args.tp))
    if tps[0] != 1:
        p.error("--tp must include 1: every ratio is against TP=1")
    if args.cores_per_rank:
        from worker.cpu_affinity import allowed_cpus

        if len(allowed_cpus()) < tps[-1] * args.cores_per_rank:
            p.error(f"--cores-per-rank {args.cores_per_rank} at TP={tps[-1]} needs {tps[-1] * args.cores_per_rank} "
                    f"cores; this process may use {len(allowed_cpus())}")

    prompts, params = steady_state_workload()
    tokens = NUM_REQUESTS * MAX_TOKENS
    configs = [(tp, k) for k in args.num_scheduler_steps for tp in tps]
    print(f"TP sizes {tps}; " + (f"{args.cores_per_rank} cores per rank, every engine in worker processes"
                                if args.cores_per_rank else "cpu_threads_bind auto, TP=1 in-process"), flush=True)
    name = {(tp, k): f"TP={tp}" + (f" K={k}" if len(args.num_scheduler_steps) > 1 else "") for tp, k in configs}
    for dtype in args.dtypes:
        model = ensure_model(Path(args.model_root), dtype)
        engines = {}
        try:
            for tp, k in configs:
                core = engines[(tp, k)] = steady_state_engine(model, tp, dtype, k, args.cores_per_rank)
                timed_generate(core, prompts[:4], params)  # warm-up
            runs: dict[tuple[int, int], list[dict[str, float]]] = {c: [] for c in configs}
            for r in range(args.rounds):
                for c, core in engines.items():
                    runs[c].append(timed_generate(core, prompts, params))
                print(f"{dtype} round {r + 1}: " + "  ".join(
                    f"{name[c]} {tokens / runs[c][-1]['total']:.0f} tok/s" for c in engines), flush=True)
        finally:
            for core in engines.values():
                core.shutdown()
        for c in configs:
            xs = runs[c]
            print(f"{dtype} {name[c]}: median {statistics.median(tokens / x['total'] for x in xs):.0f} tok/s, "
                  f"prefill {statistics.median(x['prefill'] for x in xs):.3f} s, "
                  f"decode step {statistics.median(x['decode'] for x in xs) * 1e3:.1f} ms")
        for k in args.num_scheduler_steps:
            for tp in tps[1:]:
                ratios = [a["total"] / b["total"] for a, b in zip(runs[(1, k)], runs[(tp, k)])]  # TP=t tok/s / TP=1's
                label = f" K={k}" if len(args.num_scheduler_steps) > 1 else ""
                goal = ""
                if tp == 2 and args.cores_per_rank:
                    met = statistics.median(ratios) >= SCALING_GOAL
                    goal = f"; goal >= {SCALING_GOAL}x at {args.cores_per_rank} cores per rank: {'PASS' if met else 'MISS'}"
                print(f"{dtype}{label} TP={tp} / TP=1: {statistics.median(ratios):.3f} (median of {args.rounds} rounds; "
                      f"{min(ratios):.2f}-{max(ratios):.2f}){goal}", flush=True)
        first = args.num_scheduler_steps[0]
        for k in args.num_scheduler_steps[1:]:
            for tp in tps:
                gains = [a["total"] / b["total"] for a, b in zip(runs[(tp, first)], runs[(tp, k)])]
                print(f"{dtype} TP={tp}: K={k} / K={first} {statistics.median(gains):.3f} "
                      f"({min(gains):.2f}-{max(gains):.2f})", flush=True)


if __name__ == "__main__":
    main()
