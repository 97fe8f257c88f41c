"""The CPU kernels of weight-only int4/int8 layers (`wna16_cpu.c`: the GEMVs; `wna16_dequant.c`:
the tiles; `wna16_amx.c`: the AMX product; all decode blocks with `wna16_blocks.h`), and
their torch fallback.

`wna16_matmul(x, layout)` computes y = x W^T from the WNA16 layout
(models/layers/quantization/kernels/wna16_layout.py) without ever dequantising the
whole weight:

- a few tokens (decode: up to 6-16 with AVX-512, 24-32 with AVX2: `gemv_max_tokens`):
  the C GEMVs decode each 32-input block into registers once and multiply it with every
  token, so a step streams the weight at its packed size (0.5 byte a weight for int4)
  instead of bfloat16's 2; for
  bfloat16 tokens on an AVX512-BF16 CPU (a bfloat16 model's decode) int4 codes go
  straight into bfloat16 dot products (`gemv_bf16`), about half the instructions of
  the float32 GEMV;
- bfloat16 tokens from `AMX_MIN_TOKENS` on, on CPUs with AMX (`wna16_amx.c`): each
  32-row block decoded once into a panel of bfloat16 weights (rounded once, the values
  the bfloat16 tiles hold), the AMX tiles' operands: no dequantised tile to write to
  memory and read back (3.7-4x the tiles' speed at 32 tokens);
- more tokens (prefill, large batches) elsewhere: rows are dequantised a tile at a time
  (`_TILE_BYTES` of scratch; bfloat16 tiles for a bfloat16 model, whose GEMM is 2-4x
  float32's on an AVX512-BF16 CPU, and which our AVX2 kernel reads where torch's
  bfloat16 GEMM is emulated: `tile_dtype`) and multiplied by a GEMM, which is
  compute-bound there and amortises the decode over the batch.

Built on first use like the other CPU kernels (distributed/native_build.py). Where it
cannot be built, or with `TP_CPU_WNA16=0`, the same tiling runs in torch (chosen once
per process and logged by `load`). Called by the linear methods on every rank, from the
forward's thread; the GIL is released during each call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from distributed.native_build import BF16_CONVERT_H, FP16_CONVERT_H, load_kernel
from distributed.native_calls import NativeLibrary
from models.layers import cpu_bf16_gemm, cpu_sgemm
from models.layers.cpu_bf16_gemm import cpu_has_avx512_bf16
from models.layers.cpu_gemm import widens_half_dtype

if TYPE_CHECKING:
    from models.layers.quantization.kernels.wna16_layout import WNA16Layout

SOURCE = Path(__file__).with_name("wna16_cpu.c")
# The GEMVs, the tile dequantiser, a mixture of experts' decode step (wna16_moe.c), the AMX
# product and the block decoders and tile helpers they share; a change to a header rebuilds.
SOURCES = (SOURCE, SOURCE.with_name("wna16_dequant.c"), SOURCE.with_name("wna16_moe.c"),
           SOURCE.with_name("wna16_amx.c"), SOURCE.parents[2] / "amx_tiles.h", SOURCE.with_name("wna16_blocks.h"),
           SOURCE.parents[2] / "fused_moe" / "expert_pairs.h", BF16_CONVERT_H, FP16_CONVERT_H)
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBS = ("-lm",)
# Above these many tokens, dequantised tiles + a GEMM win (scripts/bench_wna16.py,
# 4096x4096 int4 on one Zen 5 core, bfloat16 tokens: the bfloat16-dot GEMV takes 1.1 ms for
# 1-4 tokens, 5.5 ms for 16, 8.1 ms for 24, tiles 4.4-7.6 ms; the float32 GEMV 1.5 ms for
# 1 token, 5.2 ms for 8). Keyed by the tiles' dtype (`tile_dtype`): float32 tiles run
# float32's slower GEMM, so the float32 GEMV is kept longer where the tiles would be
# float32 (float32 tokens, and bfloat16 ones where bfloat16 tiles have no fast GEMM).
# AVX2 builds (no AVX-512F) have their own GEMV tile (wna16_cpu.c), 2.0-2.3x the portable
# loop they had at 1-2 tokens: on the Zen 3 VM, 2026-12-06, with bfloat16 tokens of int4
# weights in groups of 128 (1536x1024, 1024x768, 4096x1024, 1024x4096), it takes 0.80-1.03x
# the time of bfloat16 tiles with the AVX2 GEMM at 24 tokens and 1.04-1.27x at 32; float32
# tiles (torch's GEMM) take 1.1-2.0x the GEMV's time at 32 tokens.
BF16_DOT_MAX_TOKENS = 16
# From this many bfloat16 tokens on, where the library has AMX tiles (wna16_amx.c), they are
# the product: the GEMVs / the tiles against them, int4 in groups of 128, 2 threads of an
# Intel Xeon VM with AMX (2026-12-07), 8192x1024, 1024x4096, 4096x4096, ms: 4 tokens 0.65 /
# 0.70, 0.33 / 0.50, 1.18 / 1.39; 8 tokens 1.28 / 0.68-0.78, 0.57 / 0.32-0.41, 2.20 /
# 1.41-1.55; 32 tokens (dequantised tiles) 2.81 / 0.76-0.82, 1.63 / 0.46-0.53, 6.07 /
# 1.49-1.62; 64 tokens 3.05 / 1.08-1.24, 2.03 / 0.83-0.87, 7.48 / 2.51-2.86.
AMX_MIN_TOKENS = 8
GEMV_MAX_TOKENS = {torch.bfloat16: 6, torch.float32: 8}
AVX2_GEMV_MAX_TOKENS = {torch.bfloat16: 24, torch.float32: 32}
SCALE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the C kernel's scale_dtype
_TILE_BYTES = 4 << 20  # float32 scratch per dequantised tile of rows


class Wna16Kernel:
    """The loaded library: the GEMV and the tile dequantiser."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path, self.lib = path, lib  # (quantization/wna16_moe.py binds the experts' entry point itself)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._gemv, self._dequant = lib.wna16_gemv, lib.wna16_dequant
        self._gemv.restype = self._dequant.restype = ctypes.c_int
        self._gemv.argtypes = [i32, p, p, i32, p, p, i64, i64, i64, p, i64, i64, p, i64, i32]
        self._dequant.argtypes = [i32, p, p, i32, p, p, i64, i64, i64, i64, p, i64, i32, i32]
        self._gemv_bf16 = lib.wna16_gemv_int4_bf16
        self._gemv_bf16.restype = ctypes.c_int
        self._gemv_bf16.argtypes = [p, p, i32, p, p, i64, i64, i64, p, i64, i64, p, i64, i32]
        # bfloat16 dot products (AVX512-BF16): the int4 decode path of bfloat16 models
        self.has_bf16_gemv = bool(lib.wna16_has_gemv_int4_bf16())
        self._amx = lib.wna16_amx_matmul
        self._amx.restype = ctypes.c_int
        self._amx.argtypes = [i32, p, p, i32, p, p, i64, i64, i64, p, i64, i64, p, i64, i32]
        lib.wna16_has_amx.restype = ctypes.c_int
        self.has_amx = bool(lib.wna16_has_amx())  # built with AMX-BF16, and this process may use the tiles

    def gemv(self, x: torch.Tensor, layout: WNA16Layout) -> torch.Tensor:
        """x [M, Kp] float32, rows contiguous -> y [M, N] float32. MemoryError if the AVX2
        build's scratch (x rearranged, 4 bytes an input a token) cannot be allocated."""
        n, kp = layout.out_features, layout.padded_in_features
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        status = self._gemv(layout.bits, layout.qweight.data_ptr(), layout.scales.data_ptr(),
                            SCALE_DTYPES[layout.scales.dtype], layout.zeros.data_ptr(),
                            layout.block_group.data_ptr(), n, kp, layout.scales.shape[1], x.data_ptr(), x.stride(0),
                            x.shape[0], y.data_ptr(), y.stride(0), torch.get_num_threads())
        if status:
            raise MemoryError("int4/int8 GEMV could not allocate its scratch")
        return y

    def gemv_bf16(self, x: torch.Tensor, layout: WNA16Layout) -> torch.Tensor | None:
        """bfloat16 tokens x [M, Kp] (rows contiguous) -> y [M, N] float32 for int4 weights,
        by bfloat16 dot products; None where this CPU or layout has no such path (no
        AVX512-BF16, 8-bit codes, an odd number of 32-input blocks). MemoryError if its
        scratch (x rearranged, 2 bytes an input a token) cannot be allocated."""
        if not (self.has_bf16_gemv and layout.bits == 4 and layout.padded_in_features % 64 == 0):
            return None
        y = torch.empty(x.shape[0], layout.out_features, dtype=torch.float32)
        status = self._gemv_bf16(layout.qweight.data_ptr(), layout.scales.data_ptr(),
                                 SCALE_DTYPES[layout.scales.dtype], layout.zeros.data_ptr(),
                                 layout.block_group.data_ptr(), layout.out_features, layout.padded_in_features,
                                 layout.scales.shape[1], x.data_ptr(), x.stride(0), x.shape[0], y.data_ptr(),
                                 y.stride(0), torch.get_num_threads())
        if status:
            raise MemoryError("int4 GEMV could not allocate its scratch")
        return y

    def amx_matmul(self, x: torch.Tensor, layout: WNA16Layout) -> torch.Tensor | None:
        """bfloat16 tokens x [M, Kp] (unit stride along Kp) -> y [M, N] float32 on AMX tiles
        (wna16_amx.c; `has_amx` only), the weights rounded once to bfloat16 as the tiles'
        are, float32 sums; None where the tiles are refused. MemoryError where its scratch
        (the tokens, 2 bytes an input padded to 32 tokens; 64 bytes an input a thread)
        cannot be allocated."""
        y = torch.empty(x.shape[0], layout.out_features, dtype=torch.float32)
        status = self._amx(layout.bits, layout.qweight.data_ptr(), layout.scales.data_ptr(),
                           SCALE_DTYPES[layout.scales.dtype], layout.zeros.data_ptr(), layout.block_group.data_ptr(),
                           layout.out_features, layout.padded_in_features, layout.scales.shape[1], x.data_ptr(),
                           x.stride(0), x.shape[0], y.data_ptr(), y.stride(0), torch.get_num_threads())
        if status == 1:
            raise MemoryError("int4/int8 AMX product could not allocate its scratch")
        return y if status == 0 else None

    def dequant_rows(self, layout: WNA16Layout, start: int, out: torch.Tensor) -> None:
        """out [rows, Kp] (float32, or bfloat16: rounded; rows contiguous) = rows
        [start, start + rows) of W."""
        self._dequant(layout.bits, layout.qweight.data_ptr(), layout.scales.data_ptr(),
                      SCALE_DTYPES[layout.scales.dtype], layout.zeros.data_ptr(),
                      layout.block_group.data_ptr(), start, out.shape[0], layout.padded_in_features,
                      layout.scales.shape[1], out.data_ptr(), out.stride(0), int(out.dtype == torch.bfloat16),
                      torch.get_num_threads())


def dequant_rows_torch(layout: WNA16Layout, start: int, out: torch.Tensor) -> None:
    """The portable `dequant_rows`: the same values, by torch ops on one tile."""
    rows, kp = out.shape
    packed = layout.qweight[start : start + rows]
    if layout.bits == 4:
        blocks = packed.view(rows, kp // 32, 16)
        codes = torch.stack([blocks & 15, blocks >> 4], dim=2).reshape(rows, kp)
    else:
        codes = packed
    group = layout.block_group.repeat_interleave(32).long()
    scales = layout.scales[start : start + rows].index_select(1, group).float()
    zeros = layout.zeros[start : start + rows].index_select(1, group)
    out.copy_((codes.float() - zeros.float()) * scales)


def tile_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the dequantised tiles for x's dtype: bfloat16 for bfloat16 tokens
    where a bfloat16 weight has a fast GEMM (`_half_gemm`), float32 elsewhere."""
    return torch.bfloat16 if x_dtype == torch.bfloat16 and _half_gemm() != "none" else torch.float32


def _half_gemm() -> str:
    """The GEMM of bfloat16 tiles: torch's ("torch") where the CPU has AVX512-BF16;
    else our AVX2 kernel that widens a bfloat16 weight as it reads it ("avx2",
    `cpu_sgemm.linear_half`) wherever a bfloat16 dense layer's weights go through it
    (`cpu_gemm.widens_half_dtype`, which `TP_CPU_BF16_GEMM=0` and `TP_CPU_PACKED_GEMM`
    turn off as for those), since torch's bfloat16 GEMM is an emulation on such CPUs (20
    GFLOP/s against float32's 85-135 at 32-128 tokens of a 4096x1024 weight, 2026-12-06,
    the Zen 3 VM, 2 threads); "none" where neither (float32 tiles and torch's float32
    GEMM). The AVX2 kernel with bfloat16 tiles against float32 tiles there: 2.5 against
    3.5 ms at 32 tokens of that weight, 1.8 against 2.8 at 16. Asked on every batch's
    tiles (a few microseconds against their milliseconds)."""
    if cpu_has_avx512_bf16():
        return "torch"
    return "avx2" if widens_half_dtype(torch.bfloat16) else "none"


@functools.cache
def gemv_max_tokens() -> dict[torch.dtype, int]:
    """Up to how many tokens the float32 GEMV beats tiles of each dtype on this CPU (whose
    instructions the kernels are built for): AVX2_GEMV_MAX_TOKENS without AVX-512F, else
    GEMV_MAX_TOKENS."""
    return GEMV_MAX_TOKENS if cpu_sgemm.cpu_has_avx512() else AVX2_GEMV_MAX_TOKENS


def wna16_matmul(x: torch.Tensor, layout: WNA16Layout, kernel: Wna16Kernel | None) -> torch.Tensor:
    """y [M, N] = x [M, Kp] (float32 or bfloat16, contiguous, already in the layout's input
    order) times W^T; float32 from the GEMVs, `tile_dtype(x.dtype)` from the tiles.
    `kernel` None: torch only. bfloat16 x of up to BF16_DOT_MAX_TOKENS tokens: the
    bfloat16-dot GEMV (int4, AVX512-BF16); else up to `gemv_max_tokens()[tile dtype]`
    tokens the float32 GEMV; above, tiles of W in `tile_dtype` (bfloat16 tiles for bfloat16 x
    where they have a fast GEMM: the weight rounded to bfloat16, as a bfloat16 model's
    weights are), at most `_TILE_BYTES` (or 64 rows) of scratch."""
    m = x.shape[0]
    if kernel is not None and kernel.has_amx and x.dtype == torch.bfloat16 and m >= AMX_MIN_TOKENS:
        y = kernel.amx_matmul(x, layout)
        if y is not None:
            return y
    if kernel is not None and x.dtype == torch.bfloat16 and m <= BF16_DOT_MAX_TOKENS:
        y = kernel.gemv_bf16(x, layout)
        if y is not None:
            return y
    # (the tile dtype, a few microseconds to ask, only where the two limits disagree)
    limits = gemv_max_tokens()
    if kernel is not None and (m <= min(limits.values()) or m <= limits[tile_dtype(x.dtype)]):
        return kernel.gemv(x.to(torch.float32), layout)
    n, kp = layout.out_features, layout.padded_in_features
    dtype = tile_dtype(x.dtype)
    widen = dtype == torch.bfloat16 and _half_gemm() == "avx2"
    x = x.to(torch.float32 if widen else dtype)
    tile_rows = max(64, _TILE_BYTES // (dtype.itemsize * kp))
    scratch = torch.empty(min(tile_rows, n), kp, dtype=dtype)
    y = torch.empty(x.shape[0], n, dtype=dtype)
    dequant = kernel.dequant_rows if kernel is not None else dequant_rows_torch
    for start in range(0, n, tile_rows):
        rows = min(tile_rows, n - start)
        tile = scratch[:rows]
        dequant(layout, start, tile)
        y[:, start : start + rows] = (cpu_sgemm.load().linear_half(x, tile) if widen
                                      else cpu_bf16_gemm.linear(x, tile) if dtype == torch.bfloat16 else x @ tile.t())
    return y


def build_or_load() -> Wna16Kernel | None:
    """The kernels, built if this machine has none cached; None where they cannot be (the
    reason is logged) or `TP_CPU_WNA16=0`."""
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBS, Wna16Kernel,
                       "CPU int4/int8 weight kernels unavailable (%s); quantised layers dequantise tiles in torch",
                       switch="TP_CPU_WNA16")


# Once per process: every layer shares the loaded library.
load = functools.cache(build_or_load)
