"""A bfloat16 GEMM on the CPU that reads the weight as the checkpoint stores it.

oneDNN's bf16 product wants the weight reordered into its blocked layout: done per call
(F.linear), that reorder costs 3-4x the product at one row; done once after loading
(`cpu_gemm.PackedWeight`), it is most of a load (0.65 s of 1.0 s for a 1.34 GB llama on
the 2-core Zen 5 VM, 2026-12-04) and a full rewrite of every weight. `cpu_bf16_gemm.c`
needs neither: with AVX-512 BF16's VDPBF16PS each output is a dot product of two
contiguous runs (a weight row and an activation row), so the [out, in] weight is used
where it was loaded. Up to `MAX_ROWS` rows it is the product; above, where the reorder
is a few per cent of the work, F.linear is.

Built on first use like the other CPU kernels (distributed/native_build.py), only on CPUs
with AVX-512 BF16; `TP_CPU_BF16_GEMM=0` turns it off for the weights loaded after (the
linear method then packs them with oneDNN, as before). Called on every rank, from
`CPUUnquantizedLinearMethod.apply`, with this rank's shard; holds no memory beyond the
output.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from distributed.native_build import BF16_CONVERT_H, cpu_flags, load_kernel
from distributed.native_calls import NativeLibrary

SOURCE = Path(__file__).with_name("cpu_bf16_gemm.c")
# The headers it includes: a change to one rebuilds the library.
SOURCES = (SOURCE, SOURCE.with_name("bf16_tile.h"), SOURCE.with_name("tile_sum.h"), SOURCE.with_name("half_dot.h"),
           SOURCE.with_name("bf16_row_dot.h"), BF16_CONVERT_H)
SWITCH = "TP_CPU_BF16_GEMM"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
# Up to this many rows the kernel is the product; see the module docstring.
MAX_ROWS = 64


class Bf16GemmKernel:
    """The loaded library's `bf16_linear`."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path = path
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linear = lib.bf16_linear
        self._linear.restype = None
        self._linear.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, i64, i32]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias [N]), all bfloat16 CPU tensors with unit
        stride along K (the caller checks, `serves`); a new [M, N] bfloat16 tensor."""
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self._linear(x.data_ptr(), x.stride(0), m, weight.data_ptr(), weight.stride(0), n, k,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
        return out


def cpu_has_avx512_bf16() -> bool:
    flags = cpu_flags().split()
    return "avx512_bf16" in flags and "avx512bw" in flags and "avx512vl" in flags


@functools.cache
def load() -> Bf16GemmKernel | None:
    """The kernel, built if this machine has none cached; None on a CPU without AVX-512
    BF16, where it cannot be built (logged once) or with `TP_CPU_BF16_GEMM=0`."""
    if not cpu_has_avx512_bf16():
        return None
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, (), Bf16GemmKernel,
                       "CPU bf16 GEMM unavailable (%s); bf16 weights are packed by oneDNN",
                       switch=SWITCH)


def serves(weight: torch.Tensor) -> bool:
    """Whether `weight` can stay as it is and be multiplied here: a 2-D bfloat16 CPU weight
    with unit stride along its input dimension, on a CPU where the kernel loads, and
    `TP_CPU_BF16_GEMM` is not "0" (read on each call: asked once per weight, at load)."""
    return (os.environ.get(SWITCH, "1") != "0" and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.stride(1) == 1 and load() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): the kernel for up to MAX_ROWS rows of bfloat16 input
    and a weight that `serves`, F.linear otherwise (any other input, or a weight a
    caller replaced since)."""
    kernel = load()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (kernel is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not 0 < rows <= MAX_ROWS
            or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.stride(1) != 1
            or weight.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return kernel.linear(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
