#!/usr/bin/env python3
"""Generation throughput: `EngineCore.generate` vs transformers' batched `generate`.

One ~100M-parameter random llama (hidden 768, 12 layers, 12 heads / 4 KV heads,
intermediate 2048, vocab 32000, tied embeddings), N requests of varied prompt length,
greedy, `max_tokens` each with EOS ignored (transformers: `min_new_tokens` forces the same
length). Prints output tokens/s of each and the ratio, for TP=1 and (unless --tp 1) TP=2.
Not a test: timings on a shared machine are noisy, so each figure is the best of
--repeats runs. `--profile` writes a cProfile of our TP=1 run (in-process worker, so
the model runner, attention and sampler show up) and prints its top entries.

    python scripts/bench_serve.py [--device cpu] [--num-requests 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.make_tiny_model import make_tiny_model  # noqa: E402

MODEL_SPEC = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                  tie_word_embeddings=True, num_shards=1)


def param_count(spec: dict) -> int:
    h, inter, layers, heads, kv = (spec[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads"))
    hd = h // heads
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter + 2 * h
    embed = spec["vocab_size"] * h * (1 if spec["tie_word_embeddings"] else 2)
    return embed + layers * per_layer + h


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, vocab) for _ in range(rng.randint(31, 127))] for _ in range(n)]


def bench_ours(model: str, prompts: list[list[int]], max_tokens: int, tp: int, device: str, repeats: int,
               profile_path: str | None = None, threads: int | None = None) -> tuple[float, list[list[int]]]:
    from engine.core import EngineCore
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    kv_bytes = 512 << 20
    with EngineCore(model=model, tensor_parallel_size=tp, device=device, dtype="float32",
                    kv_cache_memory_bytes=kv_bytes, max_num_seqs=max(len(prompts), 1),
                    use_tqdm_on_load=False) as core:
        if threads and tp == 1:
            torch.set_num_threads(threads)  # the TP=1 worker runs in this process
        core.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
        best, outputs = float("inf"), []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = core.generate(prompts, params)
            best = min(best, time.perf_counter() - start)
        if profile_path:
            profiler = cProfile.Profile()
            profiler.enable()
            core.generate(prompts, params)
            profiler.disable()
            profiler.dump_stats(profile_path)
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    return len(prompts) * max_tokens / best, [o.token_ids for o in outputs]


def bench_transformers(model: str, prompts: list[list[int]], max_tokens: int, device: str,
                       repeats: int, threads: int | None = None) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    pad = 3  # make_tiny_model's <pad>
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(do_sample=False, pad_token_id=pad, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    with torch.inference_mode():
        hf.generate(input_ids[:2], attention_mask=attention_mask[:2], **{**kwargs, "max_new_tokens": 4,
                                                                         "min_new_tokens": 4})
        best, out = float("inf"), None
        for _ in range(repeats):
            start = time.perf_counter()
            out = hf.generate(input_ids, attention_mask=attention_mask, **kwargs)
            best = min(best, time.perf_counter() - start)
    assert out is not None and out.shape[1] == width + max_tokens
    return len(prompts) * max_tokens / best, out[:, width:].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tp", type=int, default=2, help="also measure this TP size (1: skip)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", default=None, metavar="FILE", help="cProfile our TP=1 run into FILE")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for transformers and our in-process TP=1 worker (default: torch's / "
                        "the worker's own choice, cores // tp)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        model = Path(args.model_dir or tmp) / "llama-100m"
        if not (model / "config.json").is_file():
            make_tiny_model(model, "llama", **MODEL_SPEC)
        threads = args.threads or torch.get_num_threads()
        print(f"model: llama, {param_count(MODEL_SPEC) / 1e6:.1f}M parameters, float32, device={args.device}; "
              f"{args.num_requests} requests, prompts 32-128 tokens, {args.max_tokens} new tokens each, greedy; "
              f"torch threads (TP=1 and transformers): {threads}")
        prompts = make_prompts(args.num_requests, MODEL_SPEC["vocab_size"])

        ours, our_tokens = bench_ours(str(model), prompts, args.max_tokens, 1, args.device, args.repeats,
                                      args.profile, args.threads)
        print(f"ours TP=1:     {ours:8.1f} output tokens/s")
        theirs, hf_tokens = bench_transformers(str(model), prompts, args.max_tokens, args.device, args.repeats,
                                                args.threads)
        print(f"transformers:  {theirs:8.1f} output tokens/s")
        print(f"ratio ours TP=1 / transformers: {ours / theirs:.2f}x (target >= 2x)")
        same = sum(a == b for a, b in zip(our_tokens, hf_tokens))
        print(f"greedy outputs identical to transformers: {same}/{len(prompts)} requests")
        if args.tp > 1:
            ours_tp, _ = bench_ours(str(model), prompts, args.max_tokens, args.tp, args.device, args.repeats)
            print(f"ours TP={args.tp}:     {ours_tp:8.1f} output tokens/s ({ours_tp / theirs:.2f}x transformers)")
        if args.profile:
            out = io.StringIO()
            pstats.Stats(args.profile, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue())


if __name__ == "__main__":
    main()
