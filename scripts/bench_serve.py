#!/usr/bin/env python3
"""Generation throughput: `EngineCore.generate` vs transformers' batched `generate`.

One ~100M-parameter random llama (hidden 768, 12 layers, 12 heads / 4 KV heads,
intermediate 2048, vocab 32000, tied embeddings), N requests of varied prompt length,
greedy, `max_tokens` each with EOS ignored (transformers: `min_new_tokens` forces the same
length). Prints output tokens/s of each and the ratio, for TP=1 and (unless --tp 1) TP=2.
Not a test: timings on a shared machine are noisy, so the two sides' runs alternate
and each figure is the best of --repeats runs. `--profile` writes a cProfile of our TP=1 run (in-process worker, so
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


class Ours:
    """An EngineCore kept up across runs; `run()` times one `generate` of all prompts."""

    def __init__(self, model: str, prompts: list[list[int]], max_tokens: int, tp: int, device: str,
                 threads: int | None, prepack: bool) -> None:
        import torch

        from engine import SamplingParams
        from engine.core import EngineCore

        self.prompts = prompts
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.core = EngineCore(model=model, tensor_parallel_size=tp, device=device, dtype="float32",
                               kv_cache_memory_bytes=512 << 20, max_num_seqs=max(len(prompts), 1),
                               use_tqdm_on_load=False, cpu_prepack_weights=prepack)
        if threads and tp == 1:
            torch.set_num_threads(threads)  # the TP=1 worker runs in this process
        self.core.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up

    def run(self) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = self.core.generate(self.prompts, self.params)
        elapsed = time.perf_counter() - start
        assert all(len(o.token_ids) == self.params.max_tokens for o in outputs)
        return elapsed, [o.token_ids for o in outputs]

    def profile(self, path: str) -> None:
        profiler = cProfile.Profile()
        profiler.enable()
        self.core.generate(self.prompts, self.params)
        profiler.disable()
        profiler.dump_stats(path)

    def close(self) -> None:
        self.core.shutdown()


class Transformers:
    """transformers' batched, left-padded greedy `generate`, forced to the same lengths."""

    def __init__(self, model: str, prompts: list[list[int]], max_tokens: int, device: str,
                 threads: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
        pad = 3  # make_tiny_model's <pad>
        self.width = max(len(p) for p in prompts)
        self.input_ids = torch.tensor([[pad] * (self.width - len(p)) + p for p in prompts], device=device)
        self.attention_mask = torch.tensor([[0] * (self.width - len(p)) + [1] * len(p) for p in prompts],
                                           device=device)
        self.kwargs = dict(do_sample=False, pad_token_id=pad, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        with torch.inference_mode():  # warm-up
            self.hf.generate(self.input_ids[:2], attention_mask=self.attention_mask[:2],
                             **{**self.kwargs, "max_new_tokens": 4, "min_new_tokens": 4})

    def run(self) -> tuple[float, list[list[int]]]:
        import torch

        with torch.inference_mode():
            start = time.perf_counter()
            out = self.hf.generate(self.input_ids, attention_mask=self.attention_mask, **self.kwargs)
            elapsed = time.perf_counter() - start
        assert out.shape[1] == self.width + self.kwargs["max_new_tokens"]
        return elapsed, out[:, self.width:].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tp", type=int, default=2, help="also measure this TP size (1: skip)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-cpu-prepack", action="store_true",
                   help="run ours with cpu_prepack_weights=False (the plain sgemm path), for comparison")
    p.add_argument("--profile", default=None, metavar="FILE", help="cProfile our TP=1 run into FILE")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for transformers and our in-process TP=1 worker (default: torch's / "
                        "the worker's own choice, cores // tp)")
    args = p.parse_args()
    # Imported once the flags are read, so that --help loads no torch.
    import torch

    from engine.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        model = Path(args.model_dir or tmp) / "llama-100m"
        if not (model / "config.json").is_file():
            make_tiny_model(model, "llama", **MODEL_SPEC)
        threads = args.threads or torch.get_num_threads()
        print(f"model: llama, {param_count(MODEL_SPEC) / 1e6:.1f}M parameters, float32, device={args.device}; "
              f"{args.num_requests} requests, prompts 32-128 tokens, {args.max_tokens} new tokens each, greedy; "
              f"torch threads (TP=1 and transformers): {threads}")
        prompts = make_prompts(args.num_requests, MODEL_SPEC["vocab_size"])
        tokens = len(prompts) * args.max_tokens

        # Runs alternate (ours, theirs, ours, ...) so that a change in the host's load
        # hits both sides alike; each side reports its best run.
        ours = Ours(str(model), prompts, args.max_tokens, 1, args.device, args.threads, not args.no_cpu_prepack)
        theirs = Transformers(str(model), prompts, args.max_tokens, args.device, args.threads)
        our_times, their_times = [], []
        for _ in range(args.repeats):
            elapsed, our_tokens = ours.run()
            our_times.append(elapsed)
            elapsed, hf_tokens = theirs.run()
            their_times.append(elapsed)
        if args.profile:
            ours.profile(args.profile)
        ours.close()
        del theirs
        ours_tps, theirs_tps = tokens / min(our_times), tokens / min(their_times)
        print(f"ours TP=1:     {ours_tps:8.1f} output tokens/s   (runs: {fmt(our_times)} s)")
        print(f"transformers:  {theirs_tps:8.1f} output tokens/s   (runs: {fmt(their_times)} s)")
        print(f"ratio ours TP=1 / transformers: {ours_tps / theirs_tps:.2f}x (target >= 2x)")
        same = sum(a == b for a, b in zip(our_tokens, hf_tokens))
        print(f"greedy outputs identical to transformers: {same}/{len(prompts)} requests")
        if args.tp > 1:
            ours_tp = Ours(str(model), prompts, args.max_tokens, args.tp, args.device, None, not args.no_cpu_prepack)
            tp_times = [ours_tp.run()[0] for _ in range(args.repeats)]
            ours_tp.close()
            tp_tps = tokens / min(tp_times)
            print(f"ours TP={args.tp}:     {tp_tps:8.1f} output tokens/s ({tp_tps / theirs_tps:.2f}x transformers; "
                  f"runs: {fmt(tp_times)} s)")
        if args.profile:
            out = io.StringIO()
            pstats.Stats(args.profile, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue())


def fmt(times: list[float]) -> str:
    return " ".join(f"{t:.2f}" for t in times)


if __name__ == "__main__":
    main()
