"""Run by every rank under torchrun (tests/test_external_launcher.py): build an
EngineCore with distributed_executor_backend="external_launcher", generate the same
prompts on every rank, and write what this rank got to OUT_DIR/rank{RANK}.json.

    torchrun --nproc-per-node 2 -m tests.external_launcher_generate MODEL OUT_DIR \\
        [--rank0-kv-bytes N] [--diverge] [--num-scheduler-steps K]

--rank0-kv-bytes gives rank 0 a KV budget of its own (the others keep the tests'
default), so the test sees every rank size its cache by the smallest budget.
--diverge breaks the contract on purpose: rank 1 adds the prompts in another order.
--num-scheduler-steps runs multi-step decode; the result records the most steps one
output ran ("max_steps").

The prompts and sampling settings live here (`PROMPTS`, `GREEDY`, `SAMPLED`), so the
test can run the same ones on the multiprocess backend as its reference.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from config import SamplingParams

PROMPTS = [[1, 17, 42, 99, 3], [250, 4, 8, 15, 16, 23, 42], list(range(10, 40))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Random draws: one request with its own seed, one keyed by the engine seed and its id.
SAMPLED = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, logprobs=2),
           SamplingParams(max_tokens=12, temperature=0.8, top_k=20, ignore_eos=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rank0-kv-bytes", type=int, default=None)
    parser.add_argument("--diverge", action="store_true")
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    args = parser.parse_args()

    from engine.core import EngineCore
    from tests.runtime_helpers import KV_BYTES, engine_config

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    kv_bytes = args.rank0_kv_bytes if args.rank0_kv_bytes is not None and rank == 0 else KV_BYTES
    config = engine_config(args.model, tp=tp, distributed_executor_backend="external_launcher",
                           kv_cache_memory_bytes=kv_bytes, num_scheduler_steps=args.num_scheduler_steps)
    prompts = PROMPTS[::-1] if args.diverge and rank == 1 else PROMPTS
    with EngineCore(config) as core:
        max_steps = 0
        step = core.step

        def counting_step():  # noqa: ANN202
            nonlocal max_steps
            outputs = step()
            max_steps = max(max_steps, core.last_step_num_steps)
            return outputs

        core.step = counting_step
        greedy = core.generate(prompts, GREEDY)
        sampled = core.generate(PROMPTS[:2], SAMPLED)
        result = {
            "rank": core.model_executor.rank,
            "pid": os.getpid(),
            "num_blocks": core.kv_cache_config.num_blocks,
            "per_rank_timings": len(core.startup_timings["per_rank"]),
            "ready_s": core.startup_timings["total"],
            "greedy": [o.token_ids for o in greedy],
            "sampled": [o.token_ids for o in sampled],
            "sampled_logprobs": [[{str(k): v for k, v in step.items()} for step in sampled[0].logprobs]],
            "max_steps": max_steps,
        }
    (args.out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
