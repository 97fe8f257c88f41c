"""A bfloat16 GEMM on the CPU that reads the weight as the checkpoint stores it.

oneDNN's bf16 product wants the weight reordered into its blocked layout: done per call
(F.linear), that reorder costs 3-4x the product at one row; done once after loading
(`cpu_gemm.PackedWeight`), it is most of a load (0.65 s of 1.0 s for a 1.34 GB llama on
the 2-core Zen 5 VM, 2026-12-04) and a full rewrite of every weight. `cpu_bf16_gemm.c`
needs neither: with AVX-512 BF16's VDPBF16PS each output is a dot product of two
contiguous runs (a weight row and an activation row), so the [out, in] weight is used
where it was loaded. On CPUs with AMX (Sapphire Rapids and later), whose tiles multiply
several times faster than VDPBF16PS, `amx_bf16.c` takes a 16 x 32 block of the weight as
it lies as a tile operand (the tokens are rearranged instead, once a call).

Which product, by rows of input (`dot_max_rows`): VDPBF16PS up to MAX_ROWS (a CPU
without AMX: above, oneDNN's reorder is a few per cent of the work) or up to
AMX_DOT_MAX_ROWS (while both are bound by reading the weight) then our AMX tiles up to
AMX_MAX_ROWS where this library has them, or up to ONEDNN_AMX_MAX_ROWS where only
oneDNN's GEMM runs on AMX; F.linear above.

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
# With the AMX tiles' file, one library; the headers they include: a change to one rebuilds it.
SOURCES = (SOURCE, SOURCE.with_name("amx_bf16.c"), SOURCE.with_name("amx_tiles.h"), SOURCE.with_name("bf16_tile.h"),
           SOURCE.with_name("tile_sum.h"), SOURCE.with_name("half_dot.h"), SOURCE.with_name("bf16_row_dot.h"),
           BF16_CONVERT_H)
SWITCH = "TP_CPU_BF16_GEMM"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
# Rows of input per product (see the module docstring). Time against F.linear's, whole
# calls, 2 threads of an Intel Xeon VM with AMX (2026-12-07), weights cycled through
# 2304x768 and 2048x768 / 4096x4096, 11008x4096, 4096x11008: VDPBF16PS 1-4 rows
# 0.41-0.60 / 0.60-1.08, 6 rows 0.74-0.90 / 0.94-1.05, 8 rows 0.92-1.09 / 1.15-1.25, 32
# rows 3.1-3.2 / 3.5-3.6; our AMX tiles 1-4 rows 0.56-0.66 / 0.65-0.80, 6-32 rows
# 0.55-0.70 / 0.58-0.74, 64 rows 0.75-0.86 / 0.74-0.77, 128 rows 1.10-1.31 / 0.84-1.18.
# From memory (weights cycled past the L3), 1-4 rows both read 17-27 GB/s.
MAX_ROWS = 64
AMX_DOT_MAX_ROWS = 4
AMX_MAX_ROWS = 64
ONEDNN_AMX_MAX_ROWS = 8  # ours (VDPBF16PS) / F.linear at 8 rows 0.80-1.05, 12 rows 1.16-1.50


class Bf16GemmKernel:
    """The loaded library's `bf16_linear`."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path = path
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linear = lib.bf16_linear
        self._linear.restype = None
        self._linear.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, i64, i32]
        self._amx_linear = lib.bf16_amx_linear
        self._amx_linear.restype = ctypes.c_int
        self._amx_linear.argtypes = [p, i64, i64, p, i64, i64, i64, p, p, i64, i32]
        lib.bf16_amx_available.restype = ctypes.c_int
        self.has_amx = bool(lib.bf16_amx_available())  # built with AMX-BF16, and this process may use the tiles

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias [N]), all bfloat16 CPU tensors with unit
        stride along K (the caller checks, `serves`); a new [M, N] bfloat16 tensor."""
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self._linear(x.data_ptr(), x.stride(0), m, weight.data_ptr(), weight.stride(0), n, k,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
        return out

    def amx_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`linear` on AMX tiles (amx_bf16.c; `has_amx` only), or None where the input width
        is not a multiple of 32 or the tiles are refused. MemoryError where its scratch (the
        tokens, 2 bytes an input, padded to 32 tokens) cannot be allocated."""
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        status = self._amx_linear(x.data_ptr(), x.stride(0), m, weight.data_ptr(), weight.stride(0), n, k,
                                  None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                                  torch.get_num_threads())
        if status == 1:
            raise MemoryError(f"bf16 AMX product: no memory for {m} tokens of {k} inputs")
        return out if status == 0 else None


def cpu_has_avx512_bf16() -> bool:
    flags = cpu_flags().split()
    return "avx512_bf16" in flags and "avx512bw" in flags and "avx512vl" in flags


@functools.cache
def dot_max_rows() -> int:
    """The most rows `linear` gives the VDPBF16PS kernel: AMX_DOT_MAX_ROWS where the loaded
    library has AMX tiles (`Bf16GemmKernel.has_amx`), ONEDNN_AMX_MAX_ROWS where only
    oneDNN's bf16 GEMM uses AMX (the CPU and torch allow its tiles, and
    `ONEDNN_MAX_CPU_ISA`, read once, does not stop below them), else MAX_ROWS."""
    kernel = load()
    if kernel is not None and kernel.has_amx:
        return AMX_DOT_MAX_ROWS
    return ONEDNN_AMX_MAX_ROWS if onednn_runs_amx(cpu_flags(), "amx_bf16") else MAX_ROWS


def onednn_runs_amx(flags: str, feature: str) -> bool:
    """Whether oneDNN's GEMM runs on AMX tiles for `feature` ("amx_bf16", "amx_int8"): the
    CPU `flags` name it, torch allows the tiles, and `ONEDNN_MAX_CPU_ISA` does not stop
    below them. Asked once per process by each caller (cached there)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return (feature in flags.split() and bool(getattr(torch.cpu, "_is_amx_tile_supported", bool)())
            and (isa == "ALL" or "AMX" in isa))


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
    """F.linear(x, weight, bias): for bfloat16 input and a weight that `serves`, the
    VDPBF16PS kernel up to `dot_max_rows()` rows, then (where the library has them) our
    AMX tiles up to AMX_MAX_ROWS; F.linear otherwise (more rows, an input width the tiles
    do not take, any other input, or a weight a caller replaced since)."""
    kernel = load()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    dot = rows <= dot_max_rows()
    if (kernel is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or rows <= 0
            or not (dot or (kernel.has_amx and rows <= AMX_MAX_ROWS))
            or weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.stride(1) != 1
            or weight.device.type != "cpu"
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()))):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = kernel.linear(x2, weight, bias) if dot else kernel.amx_linear(x2, weight, bias)
    if out is None:  # the tiles declined (an input width not a multiple of 32)
        return F.linear(x, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
