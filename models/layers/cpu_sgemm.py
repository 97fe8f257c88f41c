"""A float32 GEMM for AVX2 CPUs without AVX-512: a small C kernel, for float32 weights
packed once and for 16-bit weights read where they were loaded.

On the AMD dev VM (Zen 3, AVX2) oneDNN's packed product reaches 64-74 GFLOP/s on the
two cores at 32 rows (a decode step's batch) over a 100M llama's 12 layers (weights
streamed from memory, as in a step); the 6x16 register tiles of `cpu_sgemm.c`, over the
weight packed into 16-column panels, reach 82-96 GFLOP/s there: 1.5x oneDNN at 1-16
rows, 1.2-1.3x at 32-48, on par (0.93-1.07x) from 64 to 1536 rows. So one packed layout
serves every row count, and it replaces the weight (it unpacks exactly:
`cpu_gemm.PackedWeight.unpack`). MKL and oneDNN pick AVX-512 kernels where the CPU has
them, which an AVX2 kernel cannot match, so `cpu_gemm.default_packed_gemm` only picks
this one on CPUs without AVX-512.

A bfloat16/float16 weight on such a CPU (whose oneDNN has no GEMM for it) used to be
replaced by a packed float32 copy: twice the checkpoint's bytes, and most of a load.
`linear_half` multiplies it where it was loaded instead, widening it to float32 inside
the kernel (`cpu_sgemm.c`): up to 16 rows as dot products of weight rows, which read
the weight at 2 bytes a value (2.2-2.4x the packed copy at 1 row on the Zen 3 VM); above,
each 16-row panel widened per call into the packed layout's tiles (on par with it).
AVX-512 CPUs without a GEMM for the dtype take it too (float16 on every AVX-512 CPU
without AVX-512 FP16, AMD's included), with 16-lane tiles (`half_tile.h`) from 2 to 32
rows: 1.3-1.7x the dot products at 2-16 rows on the Zen 4 VM.

Built on first use like the other CPU kernels (distributed/native_build.py). With no
AVX2/FMA, no compiler or a failed build (logged), `load()` returns None and the linear
method packs with oneDNN instead. Called on every rank, from the linear methods.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from distributed.native_build import cpu_flags, load_kernel
from distributed.native_calls import NativeLibrary

SOURCE = Path(__file__).with_name("cpu_sgemm.c")
#: What the library is built from: the kernel, the transpose it shares with the GGUF tiles, and the
#: dot products and 16-lane tiles it shares with the MoE kernel.
SOURCES = (SOURCE, *(SOURCE.with_name(h) for h in ("avx2_transpose.h", "half_dot.h", "half_tile.h")))
COMPILE_FLAGS = ("-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
PANEL = 16  # the kernel's NR: output columns per packed panel


def cpu_has_avx2() -> bool:
    flags = cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def cpu_has_avx512() -> bool:
    return "avx512f" in cpu_flags().split()


class CpuSgemmKernel:
    """The loaded library: `pack` a weight once, then `linear` with it."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path = path
        self._pack, self._gemm, self._half = lib.cpu_sgemm_pack, lib.cpu_sgemm, lib.cpu_sgemm_half
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._pack.restype = self._gemm.restype = None
        self._half.restype = i32
        self._pack.argtypes = [p, i64, i64, p, i32]
        self._gemm.argtypes = [p, i64, i64, p, i64, p, p, i32]
        self._half.argtypes = [p, i64, i64, p, i64, i64, p, p, i32, i32]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A packed copy of a float32 CPU weight [n, k]: ceil(n / 16) * 16 * k floats."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"cpu_sgemm packs 2-D float32 CPU weights, not {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        w = weight.detach().contiguous()
        n, k = w.shape
        packed = torch.empty(-(-n // PANEL) * PANEL * k, dtype=torch.float32)
        self._pack(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] float32 times the packed weight [out_features, k] transposed, plus
        `bias` [out_features] (float32) if given: F.linear's result to float32 rounding.
        `packed` must come from `pack` of a weight with these out_features and k. Runs on
        torch's intra-op thread count with the GIL released; holds nothing after."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1 or x2.stride(0) != shape[-1]:
            x2 = x2.contiguous()
        rows, k = x2.shape
        if packed.numel() != -(-out_features // PANEL) * PANEL * k:
            raise ValueError(f"packed weight of {packed.numel()} floats does not fit [{out_features}, {k}]")
        out = torch.empty(rows, out_features, dtype=torch.float32)
        if bias is not None:
            bias = bias.detach().float().contiguous()
        if rows:
            self._gemm(x2.data_ptr(), rows, k, packed.data_ptr(), out_features,
                       None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out.view(*shape[:-1], out_features)

    def linear_half(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., k] float32 times a bfloat16 or float16 CPU weight [n, k] (unit stride
        along k) transposed, read where it lies, plus `bias` [n] if given: a new float32
        tensor, F.linear on the float32 values to float32 rounding. Runs on torch's
        intra-op thread count with the GIL released; holds one 16-row float32 panel per
        thread (k * 64 bytes) during the call. Raises MemoryError where that cannot be
        allocated."""
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(f"cpu_sgemm_half reads 2-D bfloat16/float16 weights with unit stride along k, not "
                             f"{weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or x2.stride(-1) != 1 or x2.stride(0) != shape[-1]:
            x2 = x2.float().contiguous()
        (rows, k), n = x2.shape, weight.shape[0]
        if weight.shape[1] != k:
            raise ValueError(f"x's {k} inputs do not fit a [{n}, {weight.shape[1]}] weight")
        out = torch.empty(rows, n, dtype=torch.float32)
        if bias is not None:
            bias = bias.detach().float().contiguous()
        if rows and n:
            status = self._half(x2.data_ptr(), rows, k, weight.data_ptr(), weight.stride(0), n,
                                None if bias is None else bias.data_ptr(), out.data_ptr(),
                                int(weight.dtype == torch.bfloat16), torch.get_num_threads())
            if status:
                raise MemoryError(f"cpu_sgemm_half: no memory for a {k * 64}-byte panel per thread")
        return out.view(*shape[:-1], n)


def build_or_load() -> CpuSgemmKernel | None:
    """The kernel, built if this machine has none cached; None on a CPU without AVX2 and
    FMA, or where it cannot be built (the reason is logged)."""
    if not cpu_has_avx2():
        return None
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, (), CpuSgemmKernel,
                       "CPU sgemm kernel unavailable (%s); packed float32 weights use oneDNN")


# Once per process: every layer shares the loaded library.
load = functools.cache(build_or_load)


def linear_half(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) in x's dtype for a bfloat16/float16 CPU weight read where
    it lies (`CpuSgemmKernel.linear_half`, products in float32, each output rounded once
    to x's dtype); F.linear itself where the kernel is not loaded or the weight is no
    longer one it reads (a caller replaced it)."""
    kernel = load()
    if (kernel is None or x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2
            or weight.dtype not in (torch.bfloat16, torch.float16) or weight.stride(1) != 1):
        return F.linear(x, weight, bias)
    return kernel.linear_half(x, weight, bias).to(x.dtype)
