"""Int4/int8 weight-only linear layers on the CPU: our WNA16 kernels against the baselines.

For each shape and batch size, one layer's y = x W^T timed (median of repeats) as:
- ours: `apply_wna16` on the WNA16 layout (the C GEMV up to 8 tokens, tiles + GEMM above);
- dequant+linear: the whole weight dequantised (by our C kernel, into a preallocated
  float32 buffer) every call, then F.linear: the best a method without a fused kernel
  can do;
- bf16 linear: F.linear on a resident bfloat16 weight (the unquantised model's cost,
  4x the int4 bytes);
and the effective weight bandwidth of ours at batch 1 (packed bytes / time). Activations
are bfloat16 (a bfloat16 model): decode takes the bfloat16-dot GEMV where the CPU has
AVX512-BF16. A weight that fits the L3 (the first default shape) is read from cache on
every repeat; the second is read from DRAM, as a model's decode reads its layers.

    python scripts/bench_wna16.py [--threads 2] [--bits 4] [--shapes 4096x4096,11008x4096]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.quantization.kernels import wna16_cpu
from models.layers.quantization.kernels.wna16_apply import apply_wna16, dequantize_wna16
from models.layers.quantization.kernels.wna16_layout import (
    get_wna16_layout,
    set_wna16_layout,
)


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def random_layer(n: int, k: int, bits: int, group: int) -> nn.Module:
    """A module holding a random [n, k] weight in the WNA16 layout."""
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
    groups = k // group
    layer = nn.Module()
    set_wna16_layout(layer, bits, lambda a, b: codes[a:b], torch.rand(n, groups) * 0.01,
                     torch.randint(0, 1 << bits, (n, groups)), torch.arange(k) // group, [])
    return layer


def bench_shape(n: int, k: int, bits: int, group: int, batches: list[int], repeats: int) -> None:
    layer = random_layer(n, k, bits, group)
    layout = get_wna16_layout(layer)
    w_bf16 = dequantize_wna16(layout).to(torch.bfloat16)
    whole = torch.empty(n, layout.padded_in_features)
    kernel = wna16_cpu.load()

    def dequant_linear(x: torch.Tensor) -> torch.Tensor:
        if kernel is not None:
            kernel.dequant_rows(layout, 0, whole)
        else:
            wna16_cpu.dequant_rows_torch(layout, 0, whole)
        return F.linear(x.float(), whole)

    packed = layout.qweight.numel() + layout.scales.numel() * (layout.scales.element_size() + 1)
    for m in batches:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        ours = timed(functools.partial(apply_wna16, layer, x, None), repeats)
        deq = timed(functools.partial(dequant_linear, x), repeats)
        plain = timed(functools.partial(F.linear, x, w_bf16), repeats)
        line = (f"{n}x{k} batch {m:3d}: ours {ours * 1e3:7.3f} ms | dequant+linear {deq * 1e3:7.3f} ms "
                f"({deq / ours:5.1f}x) | bf16 linear {plain * 1e3:7.3f} ms ({plain / ours:4.2f}x)")
        if m == 1:
            line += f" | {packed / ours / 1e9:5.1f} GB/s of packed weight"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=128)
    # 4096x4096 int4 (8 MiB) stays in a Zen 5 L3 between calls; 16384x8192 (64 MiB) does not:
    # the decode of a real model streams from DRAM, as the second shape does.
    parser.add_argument("--shapes", default="4096x4096,16384x8192")
    parser.add_argument("--batches", default="1,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernel: {'C' if wna16_cpu.load() is not None else 'torch fallback'}; threads {args.threads}; "
          f"int{args.bits}, group {args.group}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        bench_shape(n, k, args.bits, args.group, [int(b) for b in args.batches.split(",")], args.repeats)


if __name__ == "__main__":
    main()
