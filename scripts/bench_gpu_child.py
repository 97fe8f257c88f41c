"""The measuring side of scripts/bench_gpu.py: one fresh process per engine start, so
that each time to ready includes what a user's first start pays (CUDA's context, the
Triton kernels from their on-disk cache or compiled) and each process's memory figures
are its own.

A child (`bench_gpu.py --child ...`) starts our EngineCore on one checkpoint (TP=1, the
in-process `uni` backend, bfloat16, greedy, prefix caching off so that every prefill is
computed) and, with --transformers, loads the same checkpoint into transformers, then
runs `--rounds` rounds, each measurement ours then transformers' (alternating, so that
clock and thermal drift hit both alike):

  decode B   B prompts of --decode-prompt-len random token ids, --decode-tokens new
             tokens each, EOS ignored: tokens over seconds of the decode steps (ours:
             the steps in which every sequence decodes; transformers' `generate`: from
             the first token's logits to the last's).
  prefill    --prefill-seqs prompts of --prefill-len tokens, one new token each:
             prompt tokens over the seconds until that token (ours: `generate`).

Every figure is printed at once as a `RESULT {json}` line (bench_common.print_result)
with the memory it ran in: on CUDA this process's peak allocated bytes during the
measurement and the device's used bytes after it; on the CPU the resident set. A child
killed by its timeout has still reported what it measured.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench_common import print_result, warm_page_cache, weight_bytes, weight_files

CPU_KV_CACHE_BYTES = 256 << 20


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def memory(device: str) -> dict[str, int]:
    """CUDA: this process's peak allocated bytes since `reset_peak` and the device's used
    bytes now (every process's); CPU: this process's resident set."""
    import psutil
    import torch

    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return {"peak_allocated": torch.cuda.max_memory_allocated(), "device_used": total - free}
    return {"rss": psutil.Process().memory_info().rss}


def seconds_since(device: str, start: float) -> float:
    """Seconds since `start` (perf_counter), once the device's queued work is done."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids drawn in [16, vocab_size) (above the special ids)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab_size, (num, length), generator=generator).tolist()


# --------------------------------------------------------------------------- ours


def start_ours(args: argparse.Namespace) -> tuple[Any, float]:
    """Our engine on `args.model`, timed from the constructor call until it returns (the
    KV cache allocated, the CUDA graphs captured)."""
    from engine.core import EngineCore

    budget = (dict(gpu_memory_utilization=args.gpu_memory_utilization) if args.device == "cuda"
              else dict(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES))
    start = time.perf_counter()
    core = EngineCore(model=args.model, device=args.device, dtype="bfloat16", max_model_len=args.max_model_len,
                      max_num_seqs=max(args.batch_sizes + [args.prefill_seqs]),
                      max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                      enforce_eager=args.enforce_eager, use_tqdm_on_load=False, **budget)
    return core, time.perf_counter() - start


def ours_decode(core: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Every prompt to `max_tokens` new tokens, step by step; the decode rate counts the
    steps in which every sequence decodes (prefill steps run more tokens than prompts)."""
    from engine import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for prompt in prompts:
        core.add_request(prompt, params)
    decode_s, decode_tokens, steps = 0.0, 0, 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        step_start = time.perf_counter()
        core.step()
        seconds = time.perf_counter() - step_start
        if 0 < core.last_step_num_tokens <= len(prompts):
            decode_s += seconds
            decode_tokens += core.last_step_num_tokens
            steps += 1
    total = time.perf_counter() - start
    return {"tok_s": decode_tokens / decode_s, "seconds": total, "decode_steps": steps,
            "step_ms": decode_s / steps * 1e3}


def ours_prefill(core: Any, prompts: list[list[int]]) -> dict[str, float]:
    from engine import SamplingParams

    start = time.perf_counter()
    core.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False))
    seconds = time.perf_counter() - start
    return {"tok_s": sum(map(len, prompts)) / seconds, "seconds": seconds}


# --------------------------------------------------------------------------- transformers


def load_transformers(model_dir: str, device: str) -> tuple[Any, float]:
    """transformers' model of the same checkpoint in bfloat16 on `device` (SDPA
    attention, its default), and the seconds from_pretrained and the move took."""
    import importlib.util

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    # An unknown keyword would land in the config, ignored: name the one this version reads.
    kwargs: dict[str, Any] = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.bfloat16}
    if device == "cuda" and importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = device  # straight to the GPU, not through host memory
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device).eval()
    seconds = seconds_since(device, start)
    if next(model.parameters()).dtype != torch.bfloat16:
        raise RuntimeError(f"transformers loaded {next(model.parameters()).dtype}, not bfloat16")
    return model, seconds


def hf_generate(model: Any, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[float, list[float]]:
    """One greedy `generate` of exactly `max_tokens` new tokens per prompt: its start and
    the moment each token's logits were ready (a logits processor, called once per
    generated token, syncs the device and reads the clock: the first stamp ends the
    prefill, the ones after it each end one decode step)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts, device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([StepClock()]))
    if out.shape[1] != ids.shape[1] + max_tokens or len(stamps) != max_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {max_tokens}")
    return start, stamps


def hf_decode(model: Any, prompts: list[list[int]], max_tokens: int, device: str) -> dict[str, float]:
    """The decode steps' rate: tokens after the first over the time from the first
    token's logits to the last's."""
    start, stamps = hf_generate(model, prompts, max_tokens, device)
    decode_s = stamps[-1] - stamps[0]
    return {"tok_s": len(prompts) * (max_tokens - 1) / decode_s, "seconds": stamps[-1] - start,
            "decode_steps": max_tokens - 1, "step_ms": decode_s / (max_tokens - 1) * 1e3}


def hf_prefill(model: Any, prompts: list[list[int]], device: str) -> dict[str, float]:
    start, stamps = hf_generate(model, prompts, 1, device)
    return {"tok_s": sum(map(len, prompts)) / (stamps[0] - start), "seconds": stamps[0] - start}


# --------------------------------------------------------------------------- the child


def child_main(args: argparse.Namespace) -> None:
    """Start, warm up, then measure (see the module docstring); prints RESULT lines."""
    device = args.device
    engine = "ours (eager)" if args.enforce_eager else "ours"
    base = {"shape": args.shape, "device": device}

    def report(what: str, engine_name: str, figures: dict[str, Any], **extra: Any) -> None:
        print_result({**base, "engine": engine_name, "what": what, **figures, **extra, "mem": memory(device)})

    model_dir = Path(args.model)
    warm_page_cache(weight_files(model_dir))  # "from a warm page cache": the files were just written
    reset_peak(device)
    core, ready_s = start_ours(args)
    try:
        timings = {k: round(v, 3) for k, v in core.startup_timings.items() if k != "per_rank"}
        kv = core.kv_cache_config
        report("ready", engine, {"seconds": ready_s}, timings=timings, kv_cache_bytes=kv.num_blocks * kv.block_bytes,
               weights_bytes=weight_bytes(model_dir), first_start=not args.second_start,
               attention_backend=core.config.attention_config.backend,
               cuda_graph_sizes=core.config.compilation_config.cudagraph_capture_sizes)
        # A CPU cache is committed in the background once ready: let it settle before any
        # measurement (and before a ready-only child exits under it).
        core.collective_rpc("wait_kv_cache_committed")
        if args.ready_only:
            return
        vocab = args.vocab_size
        decode_prompts = ({b: random_prompts(b, args.decode_prompt_len, vocab, seed=b) for b in args.batch_sizes}
                          if args.decode else {})
        prefill_prompts = random_prompts(args.prefill_seqs, args.prefill_len, vocab, seed=1000)
        # Warm-up: every batch size's graph and every kernel the measurements meet, once.
        for prompts in decode_prompts.values():
            ours_decode(core, prompts, 4)
        if args.prefill:
            ours_prefill(core, prefill_prompts[:1])
        hf = None
        if args.transformers:
            reset_peak(device)
            hf, load_s = load_transformers(args.model, device)
            report("ready", "transformers", {"seconds": load_s})
            for prompts in decode_prompts.values():
                hf_decode(hf, prompts, 4, device)
            if args.prefill:
                hf_prefill(hf, prefill_prompts[:1], device)
        for r in range(args.rounds):
            for batch, prompts in decode_prompts.items():
                reset_peak(device)
                report("decode", engine, ours_decode(core, prompts, args.decode_tokens), batch=batch, round=r)
                if hf is not None:
                    reset_peak(device)
                    report("decode", "transformers", hf_decode(hf, prompts, args.decode_tokens, device),
                           batch=batch, round=r)
            if args.prefill:
                reset_peak(device)
                report("prefill", engine, ours_prefill(core, prefill_prompts), batch=args.prefill_seqs, round=r)
                if hf is not None:
                    reset_peak(device)
                    report("prefill", "transformers", hf_prefill(hf, prefill_prompts, device),
                           batch=args.prefill_seqs, round=r)
    finally:
        core.shutdown()


def add_child_args(parser: argparse.ArgumentParser) -> None:
    """The hidden flags the parent passes a child (the measurement flags are shared)."""
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--shape-name", dest="shape", help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--enforce-eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--transformers", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--second-start", action="store_true", help=argparse.SUPPRESS)
