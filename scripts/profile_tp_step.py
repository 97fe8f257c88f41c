"""Where a decode step's time goes at TP=N, measured inside the ranks and the engine.

The question it answers: why is TP=N as fast as it is against TP=1 on this host? Is it
the ranks' compute, their collectives (the data moved, or the wait for the slower
rank), the engine's own work on a rank's core, or the reply? bench_tp_scaling.py says
how much slower or faster TP=2 is than TP=1; this says why. Run both on a new host (more
cores, another CPU) to see whether TP pays there; the 2026-12-03 figures of the 2-vCPU
VM, and what they showed, are in docs/benchmarks.md.

One engine (bench_vs_vllm.py's workload: 32 requests of 32-128 prompt tokens, 64 new
tokens each, greedy, prefix caching off) runs `generate()` round after round, with timestamps
taken in every rank (through `collective_rpc` with a callable that wraps, in that rank's
process only, the communicator's collectives, `ModelRunner._run_step`, its
`_prepare_inputs`, and the rank's queue reads and writes) and in the engine (scheduling,
sending a step, applying a result). Per round and per rank, over the decode steps
(medians):

- `step`: the forward and the sampling of one step (`_run_step`); `coll`: the part of it
  spent inside collectives (the work of the kernel round and the wait for the peers);
  `prep`: building the step's input tensors; `gap`: from one step's end to the next's
  start: the reply (on the rank that sends it: with the engine's wake-up, which may run
  the engine's whole step on this rank's core first), reading the next step,
  `_fill_request_state`.
- At TP=2: how far apart the ranks start a step (`start r0-r1`), each rank's compute (its
  step less its collectives), how far apart those are (`|r0-r1|`, the cores' speeds and
  whatever else preempted one rank), and how much longer the step took than the slower
  rank's compute (`span - max`: the kernel rounds, and the waits of ranks that meet at
  every collective, twice a layer and a few more, each sometimes the later one).

- With `--modules`, per rank, the time a decode step spends in each kind of module (its
  calls' sum, the outermost call of each module only): the four projections, attention,
  rotary, the activation, the norms (at TP>1 with the all-reduce fused into them: its
  round and its wait included) and the greedy head (its all-gather included). Run it at
  `--tp 1` and `--tp 2` to see what the split saves a rank module by module.

    python scripts/profile_tp_step.py [--tp 2] [--dtype bfloat16] [--rounds 4] [--num-scheduler-steps 1] [--modules]

Output: per round, the throughput and the engine's median per-step costs (schedule,
send, apply, in µs); from round 2 on, a line per rank and (TP=2) the pair line above.
The first round includes first-time costs and is printed without the breakdown. The
model (bench_vs_vllm.py's 100M llama) is written once under --model-root.

Diagnostic only (the wrappers cost a few µs per call, and they reach into private
names: `ModelRunner._run_step`, `_prepare_inputs`, `EngineCore._apply`, the
communicator below its liveness wrapper; a rename there breaks it with an
AttributeError, not a wrong figure): not a benchmark, not a test. The tokens it
generates are the engine's own.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from bench_tp_scaling import steady_state_engine, steady_state_workload  # noqa: E402
from bench_vs_vllm import MAX_TOKENS, NUM_REQUESTS, ensure_model  # noqa: E402


def _timed(record: list, fn):
    """`fn` wrapped to append (start, end) of each call to `record`, outermost calls only
    (a norm that calls its own forward again is one call)."""
    depth = 0

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal depth
        depth += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            depth -= 1
            if depth == 0:
                record.append((start, time.perf_counter()))
    return wrapper


# What --modules times: the projections by their attribute name, the rest by class.
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_MODULE_CLASSES = ("Attention", "RotaryEmbedding", "SiluAndMul", "RMSNorm")
_MODULE_PREFIX = "module "


def _time_modules(model, probes: dict[str, list]) -> None:
    """Wrap every module of `model` that --modules reports, and its greedy head, each kind
    recording into probes[_MODULE_PREFIX + kind]."""
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in _PROJECTIONS:
            kind = type(module).__name__
            if kind not in _MODULE_CLASSES:
                continue
        module.forward = _timed(probes.setdefault(_MODULE_PREFIX + kind, []), module.forward)
    head = "compute_greedy_tokens"
    setattr(model, head, _timed(probes.setdefault(_MODULE_PREFIX + head, []), getattr(model, head)))


def install_probes(worker, modules: bool = False) -> bool:
    """Run on every rank (collective_rpc): wrap this process's collectives, the runner's
    step and input building, and its queue endpoints (and with `modules`, the model's
    modules: `_time_modules`), recording into `worker._probes`."""
    from distributed import parallel_state
    from executor.message_queue_reader import MessageQueueReader
    from executor.message_queue_writer import MessageQueueWriter

    probes = {"steps": [], "collectives": [], "prep": [], "enqueue": [], "dequeue": []}
    worker._probes = probes
    communicator = parallel_state.get_tp_group().communicator
    inner = getattr(communicator, "_inner", communicator)  # below the liveness wrapper
    if inner is not None:
        for name in ("all_reduce", "all_gather", "all_reduce_rms_norm"):
            setattr(inner, name, _timed(probes["collectives"], getattr(inner, name)))
    runner = worker._runner()
    run_step = runner._run_step

    def timed_step(scheduler_output):
        start = time.perf_counter()
        try:
            return run_step(scheduler_output)
        finally:
            probes["steps"].append((start, time.perf_counter(), scheduler_output.num_batched_tokens))
    runner._run_step = timed_step
    runner._prepare_inputs = _timed(probes["prep"], runner._prepare_inputs)
    if modules:
        _time_modules(runner.model, probes)
    # Class attributes: the worker process's endpoints are this rank's own.
    MessageQueueWriter.enqueue = _timed(probes["enqueue"], MessageQueueWriter.enqueue)
    MessageQueueReader.dequeue = _timed(probes["dequeue"], MessageQueueReader.dequeue)
    return True


def take_probes(worker) -> dict[str, list]:
    """Run on every rank: what the probes recorded since the last call, then clear them."""
    taken = {key: list(values) for key, values in worker._probes.items()}
    for values in worker._probes.values():
        values.clear()
    return taken


def _median_us(values) -> float:
    values = list(values)
    return statistics.median(values) * 1e6 if values else float("nan")


def _within(spans, start: float, end: float) -> list[tuple[float, float]]:
    return [(a, b) for a, b in spans if start <= a and b <= end]


def rank_summary(rank: int, probes: dict[str, list]) -> tuple[str, list]:
    """One rank's line, and its decode steps as (start, end, [collective spans])."""
    decode = [s for s in probes["steps"] if 0 < s[2] <= NUM_REQUESTS]
    steps = [(a, b, _within(probes["collectives"], a, b)) for a, b, _ in decode]
    coll = [sum(e - s for s, e in c) for _, _, c in steps]
    ordered = sorted(probes["steps"])
    gaps = [(a[1], b[0]) for a, b in zip(ordered, ordered[1:])]
    prep = [e - s for s, e in probes["prep"]]
    # Only what ran between two steps: a collective_rpc's reply (the probes') is no step's.
    replies = [e - s for g in gaps for s, e in _within(probes["enqueue"], *g)]
    reads = [e - s for g in gaps for s, e in _within(probes["dequeue"], *g)]
    line = (f"  rank {rank}: step {_median_us(b - a for a, b, _ in steps) / 1e3:.2f} ms, "
            f"coll {_median_us(coll) / 1e3:.2f} ms ({len(steps[0][2]) if steps else 0} a step), "
            f"prep {_median_us(prep):.0f} us, gap {_median_us(b - a for a, b in gaps):.0f} us")
    parts = ([f"reply {_median_us(replies):.0f} us"] if replies else []) + (
        [f"reading the next step {_median_us(reads):.0f} us"] if reads else [])
    if parts:
        line += f" (of it: {', '.join(parts)})"
    kinds = {key.removeprefix(_MODULE_PREFIX): spans for key, spans in probes.items() if key.startswith(_MODULE_PREFIX)}
    if kinds:
        per_step = {kind: _median_us(sum(e - s for s, e in _within(spans, a, b)) for a, b, _ in decode)
                    for kind, spans in kinds.items()}
        line += "\n    modules per step (ms): " + ", ".join(
            f"{kind} {us / 1e3:.2f}" for kind, us in sorted(per_step.items(), key=lambda item: -item[1]))
    return line, steps


def pair_summary(steps0: list, steps1: list) -> str:
    """TP=2: how the two ranks' decode steps line up."""
    start_diff, comp_diff, over = [], [], []
    for (a0, b0, c0), (a1, b1, c1) in zip(steps0, steps1):
        comp0 = (b0 - a0) - sum(e - s for s, e in c0)
        comp1 = (b1 - a1) - sum(e - s for s, e in c1)
        start_diff.append(a0 - a1)
        comp_diff.append(abs(comp0 - comp1))
        over.append((max(b0, b1) - max(a0, a1)) - max(comp0, comp1))
    return (f"  start r0-r1 {_median_us(start_diff):.0f} us, compute |r0-r1| {_median_us(comp_diff) / 1e3:.2f} ms, "
            f"span - max(compute) {_median_us(over) / 1e3:.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    p.add_argument("--rounds", type=int, default=4, help="generate() rounds; the first is warm-up (default 4)")
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="the engine's multi-step (default 1)")
    p.add_argument("--modules", action="store_true", help="also time each kind of module in every rank")
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench"),
                   help="where the 100M llama is written once (default ~/.cache/tp-runtime/bench)")
    args = p.parse_args()

    model = ensure_model(Path(args.model_root), args.dtype)
    prompts, params = steady_state_workload()
    core = steady_state_engine(model, args.tp, args.dtype, args.num_scheduler_steps)
    try:
        core.collective_rpc(install_probes, args=(args.modules,))
        engine = {"schedule": [], "send": [], "apply": []}
        core.scheduler.schedule = _timed(engine["schedule"], core.scheduler.schedule)
        core.model_executor.execute_model = _timed(engine["send"], core.model_executor.execute_model)
        core._apply = _timed(engine["apply"], core._apply)
        for r in range(args.rounds):
            for values in engine.values():
                values.clear()
            for prompt in prompts:
                core.add_request(prompt, params)
            start = time.perf_counter()
            while core.has_unfinished_requests():
                core.step()
            seconds = time.perf_counter() - start
            probes = core.collective_rpc(take_probes)
            # At TP=1 the in-process executor's execute_model runs the step: not a send.
            sent = "" if args.tp == 1 else f", send {_median_us(b - a for a, b in engine['send']):.0f}"
            print(f"round {r + 1}: {NUM_REQUESTS * MAX_TOKENS / seconds:.0f} tok/s; engine per step (us): "
                  f"schedule {_median_us(b - a for a, b in engine['schedule']):.0f}{sent}, "
                  f"apply {_median_us(b - a for a, b in engine['apply']):.0f}", flush=True)
            if r == 0:
                continue
            summaries = [rank_summary(rank, ranks_probes) for rank, ranks_probes in enumerate(probes)]
            for line, _ in summaries:
                print(line)
            if args.tp == 2:
                print(pair_summary(summaries[0][1], summaries[1][1]), flush=True)
    finally:
        core.shutdown()


if __name__ == "__main__":
    main()
