"""What two ranks in lockstep cost on this host, with nothing of ours in the way.

TP=2 on a 2-core host has to beat TP=1, whose one process runs every op on both cores
(oneDNN and our kernels split the rows or columns over two OpenMP threads). This probe
takes the model, the engine, Python and the data exchange out and times only the
linear layers of a decode step of bench_vs_vllm.py's 100M llama (12 layers, 32 rows,
random weights, each layer's own, so they come from memory as in a real step, packed
for oneDNN's product, one of the kernels our CPU linear method runs):

- `one process`: the full weights on two threads, as TP=1 runs them;
- `two ranks`: two processes pinned to one core each with half of every weight (the
  column-parallel qkv and gate_up split by columns, the row-parallel o and down by
  rows), meeting after every row-parallel layer, where TP=2 all-reduces: a spin on a
  shared counter, 24 meetings a step, no data.

The two alternate, round after round, and it prints each one's median step, the ratio
(two ranks / one process: above 1 is TP=2's way faster) and, for the ranks, how far apart
they reached each meeting (mean |difference|): the time the earlier one spent waiting,
which TP=2 pays at every collective and the host's jitter alone decides.

    python scripts/probe_lockstep.py [--dtype bfloat16] [--rounds 10] [--steps 20]

A diagnostic, not a benchmark of ours: it runs none of our code.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import torch

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, ROWS = 768, 2048, 12, 12, 4, 32
HEAD_DIM = HIDDEN // HEADS
# (name, out_features, in_features, split): split 0 halves the outputs, 1 the inputs.
LINEARS = [("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, 0), ("o", HIDDEN, HIDDEN, 1),
           ("gate_up", 2 * INTER, HIDDEN, 0), ("down", HIDDEN, INTER, 1)]


def make_layers(dtype: torch.dtype, shards: int) -> list[list[tuple[torch.Tensor, torch.Tensor, bool]]]:
    """Per layer, per linear: (input rows, weight, meets after it)."""
    layers = []
    for _ in range(LAYERS):
        layer = []
        for _, out_features, in_features, split in LINEARS:
            if split == 0:
                out_features //= shards
            else:
                in_features //= shards
            weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(out_features, in_features, dtype=dtype),
                                                             batch_size=ROWS)
            layer.append((torch.randn(ROWS, in_features, dtype=dtype), weight, split == 1))
        layers.append(layer)
    return layers


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def rank_main(rank: int, dtype: torch.dtype, counters, commands, results) -> None:
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    layers = make_layers(dtype, 2)
    seq = 0
    while (steps := commands.get()) is not None:
        times, gaps = [], []
        for _ in range(steps):
            start = time.perf_counter()
            for layer in layers:
                for x, weight, meets in layer:
                    linear(x, weight)
                    if meets:
                        seq += 1
                        arrived = time.perf_counter()
                        counters[rank] = seq
                        while counters[1 - rank] < seq:
                            pass
                        gaps.append(time.perf_counter() - arrived)
            times.append(time.perf_counter() - start)
        results.put((rank, times, gaps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="decode steps per round and side")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("probe_lockstep needs two cores in this process's affinity")
    dtype = getattr(torch, args.dtype)
    ctx = mp.get_context("spawn")
    counters = ctx.Array("q", 2, lock=False)
    commands = [ctx.Queue() for _ in range(2)]
    results = ctx.Queue()
    ranks = [ctx.Process(target=rank_main, args=(r, dtype, counters, commands[r], results), daemon=True)
             for r in range(2)]
    for proc in ranks:
        proc.start()
    torch.set_num_threads(2)
    layers = make_layers(dtype, 1)
    one, two, waits, ratios = [], [], [], []
    try:
        for r in range(args.rounds + 1):  # round 0 warms both sides up
            for queue in commands:
                queue.put(args.steps)
            got = dict((rank, (times, gaps)) for rank, times, gaps in (results.get(), results.get()))
            step_two = statistics.median(max(a, b) for a, b in zip(got[0][0], got[1][0]))
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                for layer in layers:
                    for x, weight, _ in layer:
                        linear(x, weight)
                times.append(time.perf_counter() - start)
            step_one = statistics.median(times)
            # The earlier arrival waits; of a pair only one of the two gaps is not ~0.
            wait = statistics.mean(a + b for a, b in zip(got[0][1], got[1][1]))
            if r == 0:
                continue
            one.append(step_one)
            two.append(step_two)
            waits.append(wait)
            ratios.append(step_one / step_two)
            print(f"round {r}: one process {step_one * 1e3:.2f} ms, two ranks {step_two * 1e3:.2f} ms "
                  f"(waiting {wait * 1e6:.0f} us a meeting)", flush=True)
    finally:
        for queue in commands:
            queue.put(None)
        for proc in ranks:
            proc.join(timeout=10)
    print(f"{args.dtype}: linears of a decode step, one process on two threads {statistics.median(one) * 1e3:.2f} ms, "
          f"two ranks on one thread each {statistics.median(two) * 1e3:.2f} ms; two ranks / one process "
          f"{statistics.median(ratios):.3f} (median of {args.rounds} rounds; {min(ratios):.2f}-{max(ratios):.2f}); "
          f"the earlier rank waits {statistics.median(waits) * 1e6:.0f} us a meeting "
          f"({statistics.median(waits) * 24 * 1e3:.2f} ms a step of 24)")


if __name__ == "__main__":
    main()
