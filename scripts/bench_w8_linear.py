#!/usr/bin/env python3
"""Benchmark: the 8-bit linear methods' CPU products against bf16 F.linear.

For each weight shape, L distinct weights (more bytes than the L3 cache, as a model's
layers are) are cycled through, so every call streams its weight from memory, as a
decode step does. Variants run interleaved and each keeps its best round, which damps
(but does not remove) noise from other processes on the machine: run it alone.

  int8_linear   W8A8 int8: per-token activation quantisation + the int8 GEMM (int8_gemm.py:
                torch._int_mm, or ours for few tokens on VNNI and on AVX2 CPUs) + scales
  fp8 channel   fp8 weights, per-channel scales (fp8_kernels.fp8_linear)
  fp8 block     fp8 weights, 128x128 block scales
  bf16          F.linear on a bfloat16 weight of the same shape

    python scripts/bench_w8_linear.py [--threads 2] [--rows 1 32] [--rounds 15]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from models.layers.quantization.fp8_kernels import fp8_linear
from models.layers.quantization.int8_gemm import int8_linear, quantize_per_token

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))


def best_times(variants: dict, layers: int, rounds: int) -> dict[str, float]:
    """Each variant's best per-call time (ms) over `rounds` interleaved rounds."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for i in range(layers):
                fn(i)
            best[name] = min(best[name], (time.perf_counter() - start) / layers * 1e3)
    return best


def bench_shape(n: int, k: int, rows_list: list[int], layers: int, rounds: int) -> None:
    w8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(layers)]
    w8_scale = [torch.rand(n, 1) + 0.1 for _ in range(layers)]
    fp8 = [torch.randn(n, k).to(torch.float8_e4m3fn) for _ in range(layers)]
    fp8_channel = [torch.rand(n, 1) for _ in range(layers)]
    fp8_block = [torch.rand(-(-n // 128), -(-k // 128)) for _ in range(layers)]
    bf16 = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(layers)]
    for rows in rows_list:
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        best = best_times({
            "int8_linear": lambda i, x=x: int8_linear(*quantize_per_token(x), w8[i], w8_scale[i], None, x.dtype),
            "fp8 channel": lambda i, x=x: fp8_linear(x, fp8[i], fp8_channel[i], 1, k),
            "fp8 block": lambda i, x=x: fp8_linear(x, fp8[i], fp8_block[i], 128, 128),
            "bf16": lambda i, x=x: F.linear(x, bf16[i]),
        }, layers, rounds)
        line = ", ".join(f"{name} {ms:.3f} ms ({best['bf16'] / ms:.2f}x bf16)" for name, ms in best.items())
        print(f"[{n}x{k}] rows={rows}: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=8, help="distinct weights per shape, cycled")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for n, k in SHAPES:
        bench_shape(n, k, args.rows, args.layers, args.rounds)


if __name__ == "__main__":
    main()
