"""What the ranks' meetings cost a TP=2 step in our engine: TP=2 with its all-reduces as
they are, with meetings that carry nothing, and with no meetings at all, against TP=1.

A TP=2 decode step of the 100M llama meets 25 times in all-reduces (each fused with the
norm after it) and once in the greedy argmax. bench_tp_scaling.py says how TP=2 fares
against TP=1; this says how much of the difference the meetings are. One TP=1 engine
and one TP=2 engine stay up in one process (bench_tp_scaling.py's workload and
set-up), and every round runs TP=1 and then TP=2 in three modes, set in every rank
through `collective_rpc` with a callable that replaces the communicator's fused
all-reduce + norm in that rank's process:

- `real`: as shipped;
- `meet`: the ranks still meet at every all-reduce, but the round carries one row, and
  each rank norms its own partial sums: what TP=2 would cost if moving the data were
  free;
- `apart`: no meeting in the all-reduces, each rank norms its own partial sums (the
  argmax still meets once a step, so every rank samples the same token): what TP=2
  would cost if the ranks never waited for each other.

The last two compute wrong hidden states (timing only: the tokens are garbage, the
shapes and the work are a real step's). Prints each round and, per mode, the median
decode step, prefill and the median per-round TP=2 / TP=1 throughput ratio.

    python scripts/profile_tp_sync.py [--dtype bfloat16] [--rounds 8]

A diagnostic, not a benchmark: never for figures of what we ship, other than `real`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_tp_scaling import steady_state_engine, steady_state_workload, timed_generate  # noqa: E402
from bench_vs_vllm import ensure_model  # noqa: E402

MODES = ("real", "meet", "apart")


def set_sync_mode(worker, mode: str) -> bool:
    """Run on every rank (collective_rpc): route this process's fused all-reduce + norm
    through `mode` (see the module docstring)."""
    from distributed import parallel_state
    from models.layers import cpu_ops

    communicator = parallel_state.get_tp_group().communicator
    inner = getattr(communicator, "_inner", communicator)  # below the liveness wrapper
    if not hasattr(worker, "_real_all_reduce_rms_norm"):
        worker._real_all_reduce_rms_norm = inner.all_reduce_rms_norm
    real = worker._real_all_reduce_rms_norm
    kernel = cpu_ops.load()
    if kernel is None:
        raise RuntimeError("profile_tp_sync needs the CPU ops kernel (models/layers/cpu_ops.c), which did not build")

    def meet(x, residual, weight, eps, norm_kernel):
        if real(x[:1], None, weight, eps, norm_kernel) is None:
            raise RuntimeError("this communicator has no fused all-reduce + norm: nothing to measure")
        return kernel.rms_norm(x, residual, weight, eps), x

    def apart(x, residual, weight, eps, norm_kernel):
        return kernel.rms_norm(x, residual, weight, eps), x

    inner.all_reduce_rms_norm = {"real": real, "meet": meet, "apart": apart}[mode]
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench"))
    args = p.parse_args()

    model = ensure_model(Path(args.model_root), args.dtype)
    prompts, params = steady_state_workload()
    engines = {}
    try:
        for tp in (1, 2):
            core = engines[tp] = steady_state_engine(model, tp, args.dtype)
            timed_generate(core, prompts[:4], params)  # warm-up
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in ("TP=1", *MODES)}
        for r in range(args.rounds):
            runs["TP=1"].append(timed_generate(engines[1], prompts, params))
            for mode in MODES:
                engines[2].collective_rpc(set_sync_mode, args=(mode,))
                runs[mode].append(timed_generate(engines[2], prompts, params))
            engines[2].collective_rpc(set_sync_mode, args=("real",))
            print(f"round {r + 1}: " + "  ".join(
                f"{name} {xs[-1]['decode'] * 1e3:.2f} ms/step" for name, xs in runs.items()), flush=True)
    finally:
        for core in engines.values():
            core.shutdown()
    for name, xs in runs.items():
        ratios = [a["total"] / b["total"] for a, b in zip(runs["TP=1"], xs)]
        label = name if name == "TP=1" else f"TP=2 {name}"
        print(f"{args.dtype} {label}: decode step {statistics.median(x['decode'] for x in xs) * 1e3:.2f} ms, "
              f"prefill {statistics.median(x['prefill'] for x in xs):.3f} s"
              + ("" if name == "TP=1" else f", / TP=1 {statistics.median(ratios):.3f} "
                 f"({min(ratios):.2f}-{max(ratios):.2f})"), flush=True)


if __name__ == "__main__":
    main()
