"""fp8 (e4m3) weights times 16/32-bit activations, read from the fp8 bytes.

`fp8_linear(x, weight, scale, block_n, block_k, bias)` computes x @ dequant(weight)^T
where dequant(weight)[r, c] = weight[r, c] * scale[r // block_n, c // block_k]
(per-channel scales: block_n = 1, block_k = in; 128x128 blocks: 128, 128). It never
dequantises the whole weight. bfloat16 x on CPUs with AMX, from `AMX_MIN_ROWS` rows on:
fp8_amx.c, whose tiles multiply a panel of each 32 weight rows' exact bfloat16 values,
each k-block's float32 sums times its scale. bfloat16 x on AVX-512 BF16 CPUs, up to
`BF16_MAX_ROWS` rows (decode, a concurrent decode, short prefills; on AMX CPUs the
fewer rows): fp8_bf16.c, whose bfloat16 dot products read the fp8 bytes as their exact
bfloat16 values, 4 weight rows at a time for every token. Otherwise up to
`GEMV_MAX_ROWS` rows of x (decode; a MoE step's tokens per
expert), the C kernel reads the fp8 bytes straight into its float32 dot products (x in
float32, one pass over the weight). Larger batches dequantise rows a tile at a time (about
`TILE_ELEMENTS` values) into a scratch buffer in x's dtype and write each tile's
F.linear product into its columns of the output (16-bit tiles through our kernels where
they beat oneDNN's: `cpu_sgemm.linear_half` on AVX2 CPUs, `cpu_bf16_gemm.linear` for
bfloat16 on AVX-512 BF16 ones, as the dense layers there): each value rounded once, to
x's dtype, so float32 activations see the exact products q * s.

The GEMV and the tile dequantiser are fp8_kernels.c, built into one library with
fp8_bf16.c, fp8_amx.c and fp8_moe.c (compiled for this CPU on first use by
distributed/native_build.py); where it cannot be built (or `TP_CPU_FP8_DEQUANT=0`),
every batch takes the tiles, dequantised by plain torch (`q.to(float32) * s`: on the
CPU ~7 ns per element, several times slower). On CUDA, every batch goes through one
Triton GEMM that reads the fp8 bytes (`kernels/fp8_triton.py`; the torch tiles where
the triton package is missing). The path is chosen once per process and logged.
Called from the fp8 methods' `apply` (checkpoint and online), on every rank, with this
rank's shard. Memory: x in float32 (decode), a panel of 4 bfloat16 weight rows per
thread (fp8_bf16.c), of 32 (fp8_amx.c, with the tokens rearranged) or one tile of
scratch, plus the output.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from distributed.native_build import BF16_CONVERT_H, load_kernel
from distributed.native_calls import NativeLibrary
from models.layers import cpu_bf16_gemm, cpu_sgemm
from models.layers.cpu_gemm import widens_half_dtype

logger = logging.getLogger(__name__)

# 2 MiB of bf16 scratch: fewer, larger F.linear calls (64 tiles of 2^18 per 4096x4096
# layer measured 9.9 ms at batch 32, 16 of 2^20 6.2 ms, the whole weight 5.9 ms).
TILE_ELEMENTS = 1 << 20
GEMV_MAX_ROWS = 16  # up to this many rows (decode batches, an expert's tokens) the C kernel reads the fp8 bytes
#: bfloat16 rows on AVX-512 BF16 CPUs: up to BF16_MAX_ROWS through fp8_bf16.c (`Fp8DequantKernel.bf16_linear`),
#: exact (as the float32 GEMV) with one scale per row (channel, tensor) and, with blocks along the input, up
#: to BF16_EXACT_MAX_ROWS, whose per-block sums cost more above than rounding q * s to bfloat16 first (as the
#: tiles do). A 4096x4096 weight from memory, 2 threads, ms (2026-12-07, the Zen 4 VM), float32 GEMV (up to 16
#: rows) or tiles through cpu_bf16_gemm / exact / rounded / the bf16 weight: 128x128 blocks, 1 row 1.85 / 1.04
#: / 1.57 / 1.46; 8 rows 3.56 / 1.73 / 1.80 / 1.26; 16 rows 6.53 (tiles 5.31) / 3.61 / 2.80 / 1.67; 32 rows
#: 5.99 / 4.83 / 3.73 / 2.96; 64 rows 8.82 / 8.71 / 6.60 / 5.73; per channel, 32 rows 5.98 / 3.42 / 3.76 /
#: 3.07, 64 rows 8.37 / 6.10 / 6.25 / 6.03.
BF16_EXACT_MAX_ROWS = 8
BF16_MAX_ROWS = 64
#: bfloat16 rows on AMX CPUs: from AMX_MIN_ROWS through fp8_amx.c (`Fp8DequantKernel.amx_linear`). 4096x4096 in
#: 128x128 blocks from memory, 2 threads, ms, the other paths / the AMX tiles (2026-12-07, an Intel Xeon VM with
#: AMX): 1 row 1.18 / 1.92, 4 rows 1.84 / 1.89, 5 rows 2.13 / 1.83, 8 rows 2.82 / 1.86, 32 rows 6.61 / 1.95,
#: 64 rows 12.51 / 3.27, 128 rows 11.22 / 5.02, 512 rows 18.77 / 17.52.
AMX_MIN_ROWS = 5
SOURCE = Path(__file__).with_name("fp8_kernels.c")
# with a mixture of experts' decode step (fp8_moe.c, fp8_moe.py's); a change to a header rebuilds
SOURCES = (SOURCE, SOURCE.with_name("fp8_moe.c"), SOURCE.with_name("fp8_bf16.c"), SOURCE.with_name("fp8_amx.c"),
           SOURCE.with_name("fp8_convert.h"), SOURCE.parent.parent / "fused_moe" / "expert_pairs.h", BF16_CONVERT_H,
           SOURCE.parent.parent / "bf16_tile.h", SOURCE.parent.parent / "tile_sum.h",
           SOURCE.parent.parent / "amx_tiles.h")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class Fp8DequantKernel:
    """The loaded fp8_kernels.c."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path, self.lib = path, lib  # (fp8_moe.py binds the experts' entry point itself)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._dequant = lib.fp8_dequant_rows
        self._dequant.restype = None
        self._dequant.argtypes = [p, i64, i64, i64, i64, p, i64, i64, i64, i32, p, i64, i32]
        self._gemv = lib.fp8_gemv
        self._gemv.restype = ctypes.c_int
        self._gemv.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, i64, i64, i32, p, i64, i32]
        lib.fp8_has_bf16_linear.restype = ctypes.c_int
        self.has_bf16_linear = bool(lib.fp8_has_bf16_linear())  # built with AVX-512 BF16
        if self.has_bf16_linear:
            self._bf16_linear = lib.fp8_bf16_linear
            self._bf16_linear.restype = ctypes.c_int
            self._bf16_linear.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, i64, i64, i32, p, i64, i32]
        self._amx_linear = lib.fp8_amx_linear
        self._amx_linear.restype = ctypes.c_int
        self._amx_linear.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, i64, i64, p, i64, i32]
        lib.fp8_has_amx.restype = ctypes.c_int
        self.has_amx = bool(lib.fp8_has_amx())  # built with AMX-BF16, and this process may use the tiles

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
             out_dtype: torch.dtype) -> torch.Tensor:
        """x [M <= GEMV_MAX_ROWS, in] float32 (rows contiguous) @ dequant(weight)^T, read
        straight from the fp8 bytes: [M, out] in `out_dtype`."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
        status = self._gemv(x.data_ptr(), x.stride(0), x.shape[0], weight.data_ptr(), weight.stride(0),
                            weight.shape[0], weight.shape[1], scale.data_ptr(), scale.stride(0), block_n, block_k,
                            _OUT_DTYPES[out_dtype], out.data_ptr(), out.stride(0), torch.get_num_threads())
        if status:
            raise ValueError(f"fp8 GEMV takes at most {GEMV_MAX_ROWS} rows, got {x.shape[0]}")
        return out

    def bf16_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                    block_k: int, round_weights: bool) -> torch.Tensor | None:
        """x [M, in] bfloat16 (unit stride along in) @ dequant(weight)^T by bfloat16 dot
        products of the weight's values (fp8_bf16.c; `has_bf16_linear` only): exact, each
        k-block's sums times its scale, or with q * s rounded to bfloat16 first
        (`round_weights`: fewer instructions at more rows). [M, out] bfloat16; None where
        block_k is neither a multiple of 32 nor the whole input. MemoryError where a
        thread's panel (8 bytes an input) could not be allocated."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
        status = self._bf16_linear(x.data_ptr(), x.stride(0), x.shape[0], weight.data_ptr(), weight.stride(0),
                                   weight.shape[0], weight.shape[1], scale.data_ptr(), scale.stride(0), block_n,
                                   block_k, int(round_weights), out.data_ptr(), out.stride(0), torch.get_num_threads())
        if status == 1:
            raise MemoryError(f"fp8 bf16 product: no memory for a {weight.shape[1]}-wide panel per thread")
        return out if status == 0 else None

    def amx_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                   block_k: int) -> torch.Tensor | None:
        """x [M, in] bfloat16 (unit stride along in) @ dequant(weight)^T on AMX tiles
        (fp8_amx.c; `has_amx` only): the bytes' exact values, each k-block's float32 sums
        times its scale. [M, out] bfloat16; None where the input width is not a multiple of
        32, block_k neither a multiple of 32 nor the whole input, or the tiles are refused.
        MemoryError where its scratch cannot be allocated."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
        status = self._amx_linear(x.data_ptr(), x.stride(0), x.shape[0], weight.data_ptr(), weight.stride(0),
                                  weight.shape[0], weight.shape[1], scale.data_ptr(), scale.stride(0), block_n,
                                  block_k, out.data_ptr(), out.stride(0), torch.get_num_threads())
        if status == 1:
            raise MemoryError(f"fp8 AMX product: no memory for a {weight.shape[1]}-wide panel per thread")
        return out if status == 0 else None

    def dequant_rows(self, weight: torch.Tensor, r0: int, rows: int, scale: torch.Tensor, block_n: int,
                     block_k: int, out: torch.Tensor) -> None:
        self._dequant(weight.data_ptr(), weight.stride(0), r0, rows, weight.shape[1], scale.data_ptr(),
                      scale.stride(0), block_n, block_k, _OUT_DTYPES[out.dtype], out.data_ptr(), out.stride(0),
                      torch.get_num_threads())


def build_or_load() -> Fp8DequantKernel | None:
    """The kernel, built if this machine has none cached; None where it cannot be (the
    reason is logged) or `TP_CPU_FP8_DEQUANT=0`."""
    kernel = load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, (), Fp8DequantKernel,
                         "fp8 dequantise kernel unavailable (%s); fp8 layers dequantise with torch ops",
                         switch="TP_CPU_FP8_DEQUANT")
    if kernel is not None and kernel.path != Path():
        logger.info("fp8 weights: GEMV and tile dequantiser %s", kernel.path.name)
    return kernel


load = functools.cache(build_or_load)


@functools.cache
def _triton_gemm() -> Callable[..., None] | None:
    """`fp8_matmul_triton`, or None where the triton package cannot be imported (logged
    once): then CUDA layers dequantise tiles with torch ops."""
    try:
        from models.layers.quantization.kernels.fp8_triton import fp8_matmul_triton
    except ImportError as e:
        logger.warning("fp8 Triton kernel unavailable (%s); fp8 layers on CUDA dequantise tiles with torch ops", e)
        return None
    return fp8_matmul_triton


def dequant_rows_torch(weight: torch.Tensor, r0: int, r1: int, scale: torch.Tensor, block_n: int,
                       block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [r0, r1) of dequant(weight) in `dtype`, with torch ops (the portable path)."""
    cols = weight.shape[1]
    s = scale[r0 // block_n : (r1 - 1) // block_n + 1].to(torch.float32)
    s = s.repeat_interleave(block_n, dim=0)[r0 % block_n : r0 % block_n + (r1 - r0)]
    if s.shape[1] > 1 or block_k < cols:
        s = s.repeat_interleave(block_k, dim=1)[:, :cols]
    return (weight[r0:r1].to(torch.float32) * s).to(dtype)


def _bf16_tiles(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bfloat16 tiles go through `cpu_bf16_gemm.linear`: an AVX-512 BF16 CPU where
    it loads, and `TP_CPU_BF16_GEMM` not "0" (as for the dense layers)."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and os.environ.get(cpu_bf16_gemm.SWITCH, "1") != "0"
            and cpu_bf16_gemm.load() is not None)


def _tile_product(dtype: torch.dtype, device: torch.device) -> Callable[..., torch.Tensor]:
    """F.linear, but for 16-bit tiles on a CPU whose oneDNN has no GEMM for their dtype
    (AVX2 CPUs) our AVX2 kernel that widens the tile as it reads it (`cpu_sgemm.
    linear_half`, the dense layers' product there): torch's converts the tile on every
    call. 32-512 tokens of a 2048x2048 or 5632x2048 fp8 weight in bf16, whole calls
    (2026-12-06, the Zen 3 VM, 2 threads): 15-21 GFLOP/s with torch's, 47-156 with ours.
    On AVX-512 BF16 CPUs, bf16 tiles go through `cpu_bf16_gemm.linear` (up to its
    MAX_ROWS rows), which reads a tile as it is where oneDNN's GEMM reorders it on every
    call: 4096x4096 in tiles, 16 rows 5.0 -> 4.9 ms, 32 rows 6.2 -> 5.6 (the Zen 4 VM)."""
    if _bf16_tiles(dtype, device):
        return cpu_bf16_gemm.linear
    return cpu_sgemm.linear_half if device.type == "cpu" and widens_half_dtype(dtype) else F.linear


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ dequant(weight [out, in])^T (+ bias) in x's dtype (see the module
    docstring); `scale` float32 [ceil(out / block_n), ceil(in / block_k)], contiguous."""
    x2 = x.reshape(-1, x.shape[-1])
    out_features, in_features = weight.shape
    dtype = x.dtype
    if weight.is_cuda and (triton_gemm := _triton_gemm()) is not None:
        out = torch.empty(x2.shape[0], out_features, dtype=dtype, device=x.device)
        triton_gemm(x2, weight, scale, block_n, block_k, out)
        if bias is not None:
            out += bias.to(dtype)
        return out.reshape(*x.shape[:-1], out_features)
    kernel = load() if (weight.device.type == "cpu" and dtype in _OUT_DTYPES and weight.stride(1) == 1
                        and scale.is_contiguous() and scale.dtype == torch.float32) else None
    rows = x2.shape[0]
    out = None
    if kernel is not None and kernel.has_amx and dtype == torch.bfloat16 and rows >= AMX_MIN_ROWS:
        out = kernel.amx_linear(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, scale, block_n, block_k)
    if (out is None and kernel is not None and kernel.has_bf16_linear and _bf16_tiles(dtype, x.device)
            and rows <= BF16_MAX_ROWS):
        out = kernel.bf16_linear(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, scale, block_n, block_k,
                                 round_weights=rows > BF16_EXACT_MAX_ROWS and block_k < in_features)
    if out is None and kernel is not None and rows <= GEMV_MAX_ROWS:  # also where bf16_linear declines
        x32 = x2.to(torch.float32)
        out = kernel.gemv(x32 if x32.stride(1) == 1 else x32.contiguous(), weight, scale, block_n, block_k, dtype)
    if out is not None:
        if bias is not None:
            out = out + bias.to(dtype)
        return out.reshape(*x.shape[:-1], out_features)
    tile_rows = max(1, TILE_ELEMENTS // max(in_features, 1))
    if tile_rows >= block_n:
        tile_rows -= tile_rows % block_n  # whole scale blocks per tile (cheaper torch scale expansion)
    tile_rows = min(tile_rows, out_features)
    if tile_rows == out_features:  # one tile: its product is the output
        out = None
    else:
        out = torch.empty(x2.shape[0], out_features, dtype=dtype, device=x.device)
    scratch = torch.empty(tile_rows, in_features, dtype=dtype, device=x.device) if kernel is not None else None
    linear = _tile_product(dtype, x.device)
    for r0 in range(0, out_features, tile_rows):
        r1 = min(r0 + tile_rows, out_features)
        if kernel is not None:
            tile = scratch[: r1 - r0]
            kernel.dequant_rows(weight, r0, r1 - r0, scale, block_n, block_k, tile)
        else:
            tile = dequant_rows_torch(weight, r0, r1, scale, block_n, block_k, dtype)
        if out is None:
            out = linear(x2, tile)
        else:
            out[:, r0:r1] = linear(x2, tile)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.reshape(*x.shape[:-1], out_features)
