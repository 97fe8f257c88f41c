"""Sleep mode against a restart, in one run: how long `wake_up()` takes after `sleep(1)`
and after `sleep(2)`, next to shutting the engine down and starting it again.

On the ~1.3 GB bfloat16 checkpoint of bench_load.py (cached under --dir), CPU, 1 GiB of
KV cache per rank. One engine stays up for the sleep cycles; the restart is a second
engine's `shutdown()` plus a new `EngineCore(...)` (spawn, process group, load, KV
allocation) in the same process. The cases alternate, repeat after repeat; each figure
is the best of --repeats. After every wake-up and restart, greedy output must equal the
first engine's. Prints each run, the memory each sleep freed per rank, and the ratios
against the targets: level-1 wake-up <= 0.3x the restart, level-2 <= 0.8x.

    python scripts/bench_sleep.py [--tp 1] [--repeats 3] [--dir .bench/load_model] [--quick]

Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench_common import GB, ensure_checkpoint
from bench_load import FULL_SPEC, QUICK_SPEC

KV_BYTES = 1 << 30
PROMPT = list(range(100, 164))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=".bench/load_model")
    p.add_argument("--quick", action="store_true", help="the ~0.2 GB model instead of ~1.3 GB")
    args = p.parse_args()
    # Imported once the flags are read, so that --help loads no torch.
    from engine import SamplingParams
    from engine.core import EngineCore

    model = ensure_checkpoint(Path(args.dir), QUICK_SPEC if args.quick else FULL_SPEC)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def start() -> EngineCore:
        return EngineCore(model=str(model), tensor_parallel_size=args.tp, device="cpu", kv_cache_memory_bytes=KV_BYTES,
                          enable_sleep_mode=True, use_tqdm_on_load=False)

    def check(core: EngineCore, what: str) -> None:
        if core.generate(PROMPT, params)[0].token_ids != reference:
            raise SystemExit(f"{what}: greedy output changed")

    core = start()
    reference = core.generate(PROMPT, params)[0].token_ids
    print(f"{model.name}, tp={args.tp}, KV {KV_BYTES / GB:.2f} GB per rank; cases alternate, best of {args.repeats}")
    best: dict[str, float] = {}
    freed: dict[int, list[dict[str, Any]]] = {}

    def record(case: str, seconds: float) -> None:
        best[case] = min(best.get(case, float("inf")), seconds)
        print(f"  {case:14s} {seconds:7.3f} s", flush=True)

    for rep in range(args.repeats):
        print(f"run {rep + 1}")
        for level in (1, 2):
            t0 = time.perf_counter()
            freed[level] = core.sleep(level)
            record(f"sleep({level})", time.perf_counter() - t0)
            t0 = time.perf_counter()
            core.wake_up()
            record(f"wake_up after {level}", time.perf_counter() - t0)
            check(core, f"wake_up after sleep({level})")
        t0 = time.perf_counter()
        core.shutdown()
        core = start()
        record("restart", time.perf_counter() - t0)
        check(core, "restart")
    core.shutdown()

    for level, reports in freed.items():
        for r in reports:
            pools = ", ".join(f"{tag} {n / GB:.2f} GB" for tag, n in r["bytes"].items())
            print(f"sleep({level}) rank {r['rank']}: freed {pools}; RSS {r['memory_before'] / GB:.2f} -> "
                  f"{r['memory_after'] / GB:.2f} GB")
    restart = best["restart"]
    for level, target in ((1, 0.3), (2, 0.8)):
        ratio = best[f"wake_up after {level}"] / restart
        print(f"level {level}: wake_up {best[f'wake_up after {level}']:.3f} s / restart {restart:.3f} s = {ratio:.2f}x "
              f"(target <= {target}x: {'met' if ratio <= target else 'MISSED'})")


if __name__ == "__main__":
    main()
