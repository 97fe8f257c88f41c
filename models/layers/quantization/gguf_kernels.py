"""The products and lookups GGUF layers compute from their blocks (`gguf_kernels.c`: float
products and dequantisers; `gguf_vnni.c`: int8 products with AVX-512 VNNI, or
`gguf_avx2.c` on AVX2 CPUs without it; `gguf_vnni_tiles.c`, `gguf_avx2_tiles.c`: int8
tiles, likewise; `gguf_bf16.c`: bf16 tiles; `gguf_moe.c`: experts, gguf_moe.py's).

`gguf_linear(qtype, blocks, k, x, out)`: out = x W^T for W held as [rows, row_bytes]
blocks of `qtype`. On the CPU, with the C kernels built:
- up to `SMALL_BATCH_TOKENS` tokens (decode), OpenMP threads over output rows (the
  process's torch threads), each block read once per 8 tokens:
  - activations in bfloat16/float16 (`INT8_ACTIVATION_DTYPES`; GGUF files load as
    float16 by default) are quantised to int8 as llama.cpp does, per 32 values for
    Q4_0/Q8_0 rows and per 256 for the K-quants' (its Q8_K), and multiplied with the
    blocks' integers by AVX-512 VNNI (`gguf_vnni.c`; on AVX2 CPUs without it, by
    vpmaddubsw and vpmaddwd: `gguf_avx2.c`); Q4_0/Q8_0 scales apply in float per 16 (32
    on AVX2) values, the K-quants' group scales in integers. A fused layer's shards (q, k, v;
    gate, up) go in one call (`gguf_linear_shards`): x is read in its 16-bit dtype and
    quantised once per scheme its shards use, and one parallel loop runs over every
    shard's rows. Error against float activations: at most sum_i |w_i| * dx_i / 2 per
    output (dx = the 32- or 256-group's max |x| / 127), of the order of the activations'
    own 16-bit rounding. An AVX2 build has no bf16 tiles: its int8 products take Q4_0
    rows up to `SMALL_BATCH_TOKENS` tokens (Q8_0 ones below 8, where its int8 tiles take
    over). Where the build has neither, the float path;
  - float32 activations: each block dequantised into L1 (AVX-512, or portable C the
    compiler vectorises) and multiplied in float32 (`gguf_gemm`): F.linear on the dequantised
    weight up to float32 rounding (16 running sums per token, fused multiply-adds).
- from `INT8_TILE_MIN_TOKENS` tokens of 16-bit activations on, every count (a
  concurrent decode's batches and every prefill), the rows the build's int8 tiles take
  (`GGUFKernels.int8_tile_min_tokens`, the library's rule: the K-quants and Q8_0 on
  every build, Q4_0 on VNNI; Q8_0 from 16 tokens where the build has bf16 tiles, which
  are faster below): the int8 tiles (`gguf_vnni_tiles.c`; on AVX2, `gguf_avx2_tiles.c`:
  vpmaddubsw and vpmaddwd, 16-bit partial sums, 128 tokens per pass over a tile; Q8_0's
  weights sign-extended to 16 bits and multiplied by 16-bit activation pairs with
  vpmaddwd, which 8-bit codes could saturate in vpmaddubsw): x quantised to int8 per 32
  values (vLLM's GGUF granularity), each 16-row tile of the weight unpacked once per call
  (per 128 tokens on AVX2) to bytes with one row per 32-bit lane and multiplied by every
  token with vpdpbusd. Error: at most sum_i |w_i| * dx_i / 2 per output, dx that of the
  value's 32. Against the bf16 tiles and the prefill GEMM below (2026-12-05, the Zen 5
  VM, 2 threads): 1.4-1.55x at 8 tokens, 1.3-1.5x at 16, 1.3x at 2048 for Q4_K and Q6_K
  weights of the 853M Llama; Q8_0 (2026-12-06, Zen 4) 1.1x at 16, 1.35x at 64, 1.5x at
  512. On the AVX2 Zen 3 VM (2026-12-06) a 5632x2048 Q4_K weight runs at 240-270 GOP/s
  at 16 tokens (from memory) and 300-360 at 128-2048, Q6_K at 180 and 230-270, Q8_0 at
  170-180 and 210-235 (its int8 rows 110-125). A fused layer's shards go in one call
  where the tiles take every one of them; a layer mixing them with other types computes
  shard by shard;
- from `BF16_TILE_MIN_TOKENS` to `BF16_TILE_MAX_TOKENS` tokens of 16-bit activations,
  on a CPU with AVX-512 BF16, the rows the int8 tiles do not take (Q8_0 below 16 tokens;
  every type where the build has no int8 tiles): each 4-row tile is dequantised to
  bfloat16 into a per-thread buffer and multiplied by every token with our bf16 register
  tile (`gguf_gemm_bf16_shards`; float16 activations are rounded to bfloat16 first). Its
  error is the weights' one bfloat16 rounding, well below the int8 path's. Against the
  int8 rows (2026-12-05, Zen 5, a 5632x2048 weight on 2 threads): Q8_0 1.9-2.2x at 8
  tokens, 2.7x at 16, 2.6-2.9x at 32;
- more tokens (prefill) of those rows: row tiles of `TILE_ROWS` rows are dequantised
  into one scratch tile (never the whole weight) and multiplied by torch's GEMM in the
  activations' dtype: for bf16 activations dequantised straight to bf16 (AVX-512 BF16
  builds), otherwise a float32 tile (with a 16-bit copy for bf16/fp16 activations where
  the CPU has a 16-bit GEMM; on AVX2, x in float32 instead).
On CUDA, the quantised types go through one Triton GEMM that reads the blocks
(`kernels/gguf_triton.py`: [tokens, rows] tiles, each 32 values of the rows dequantised
in registers into a `tl.dot`). Elsewhere (no C compiler, `TP_CPU_GGUF_KERNELS=0`, CUDA
without the triton package), `gguf_dequant.dequantize` per call then a matmul: plain
torch, on the tensor's device. The choice is made once per process, and logged when the
kernels are unavailable.

`gguf_dequantize_rows(qtype, blocks, k, ids)`: the rows `ids` as float32 (an
embedding's lookups), the same two paths.

Outputs are float32 or the activations' 16-bit dtype (the layers ask for the latter):
each is rounded once from its float32 sum, to nearest even, as `.to()` rounds a float32
output. Dequantised values equal gguf-py's bit for bit on every path. Called by the
layers on every rank; the GIL is released during each C call; the int8 path holds the
quantised activations (about 1.3 bytes per input value per token, twice where a layer's
shards read two orders) for the call, the int8 tiles 1.5 bytes per input value per
token (AVX2: 1.25, or 2.25 with a Q6_K shard) and, per thread, a 16-row tile of bytes
(16 bytes per input value; AVX2: 4 super-blocks of it, 24 KB) and its scales.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from distributed.native_build import BF16_CONVERT_H, FP16_CONVERT_H, load_kernel
from distributed.native_calls import NativeLibrary
from models.layers.cpu_gemm import lacks_native_gemm
from models.layers.quantization.gguf_dequant import (
    FLOAT_TYPES,
    GGUF_FORMATS,
    dequantize,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_kernels.c")
#: The library's sources (the module docstring's) and the headers they share.
SOURCES = (SOURCE, SOURCE.with_name("gguf_vnni.c"), SOURCE.with_name("gguf_avx2.c"), SOURCE.with_name("gguf_groups.h"),
           SOURCE.with_name("gguf_quantize_x.h"), SOURCE.parent.parent / "fused_moe" / "expert_pairs.h",
           SOURCE.with_name("gguf_vnni_tiles.c"), SOURCE.with_name("gguf_avx2_tiles.c"),
           SOURCE.with_name("gguf_avx2_unpack.h"), SOURCE.parent.parent / "tile_sum.h",
           SOURCE.with_name("gguf_bf16.c"), SOURCE.with_name("gguf_moe.c"), SOURCE.with_name("gguf_blocks.h"),
           SOURCE.parent.parent / "bf16_tile.h", SOURCE.parent.parent / "avx2_transpose.h", BF16_CONVERT_H,
           FP16_CONVERT_H)
COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBS = ("-lm",)
SMALL_BATCH_TOKENS = 16
BF16_TILE_MIN_TOKENS, BF16_TILE_MAX_TOKENS = 8, 64
#: K-quant rows times this many tokens or more of 16-bit activations: the int8 tiles, in
#: place of the int8 rows, bf16 tiles and the prefill's GEMM (every build; a build's rule
#: per type, Q8_0 from 16 on AVX-512 BF16, is `GGUFKernels.int8_tile_min_tokens`).
INT8_TILE_MIN_TOKENS = 8
#: The types every int8 tile build takes; a build's own set is `GGUFKernels.int8_tile_types`.
INT8_TILE_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q8_0"})
TILE_ROWS = 1024  # a float32 tile of 1024 x 5632 is 23 MiB: scratch, reused per layer call
#: Activation dtypes whose small-batch products quantise x to int8, as
#: llama.cpp does (where the CPU has AVX-512 VNNI or AVX2): their own rounding (bfloat16's 8
#: bits) is of the order of int8's, so it costs them little accuracy and buys the
#: integer dot products. float32 activations keep the float path (exact products).
INT8_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


# gguf_quantize_x.h's x_dtype (x_row), and gguf_blocks.h's out_t dtype
_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class ShardPlan:
    """The C arrays describing a layer's shards [(type, [rows, row_bytes] contiguous
    blocks)] for `GGUFKernels.gemm_shards`: built once per layer and storage (the
    pointers are the blocks' addresses; a caller rebuilds it when they move), so a step
    pays one C call per layer, not one array build per shard."""

    def __init__(self, shards: list[tuple[str, torch.Tensor]]) -> None:
        n = len(shards)
        self.names = [qtype for qtype, _ in shards]
        self.rows = sum(blocks.shape[0] for _, blocks in shards)
        self.qtypes = (ctypes.c_int * n)(*(GGUF_FORMATS[qtype].type_id for qtype, _ in shards))
        self.pointers = (ctypes.c_void_p * n)(*(blocks.data_ptr() for _, blocks in shards))
        self.rows_per_shard = (ctypes.c_int64 * n)(*(blocks.shape[0] for _, blocks in shards))
        self.row_bytes = (ctypes.c_int64 * n)(*(blocks.stride(0) for _, blocks in shards))


class GGUFKernels:
    """The loaded library."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path, self.lib = path, lib  # (gguf_moe.py binds the experts' entry point itself)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._gemm, self._shards, self._rows = lib.gguf_gemm, lib.gguf_gemm_q8_shards, lib.gguf_dequantize_rows
        self._bf16, self._rows_bf16 = lib.gguf_gemm_bf16_shards, lib.gguf_dequantize_rows_bf16
        self._int8_tiles = lib.gguf_gemm_int8_tiles
        self._int8_tiles.restype = ctypes.c_int
        self._int8_tiles.argtypes = [i32, p, p, p, p, i64, p, i32, i64, i64, p, i32, i64, i32]
        self._gemm.restype = self._shards.restype = self._rows.restype = self._bf16.restype = ctypes.c_int
        self._rows_bf16.restype = ctypes.c_int
        self._rows_bf16.argtypes = [i32, p, i64, i64, i64, p, i64, i32]
        self._gemm.argtypes = [i32, p, i64, i64, i64, p, i64, i64, p, i64, i32]
        self._shards.argtypes = [i32, p, p, p, p, i64, p, i32, i64, i64, p, i32, i64, i32]
        self._bf16.argtypes = [i32, p, p, p, p, i64, p, i64, i64, p, i32, i64, i32]
        self._rows.argtypes = [i32, p, i64, i64, p, i64, p, i64, i32]
        # Whether this build has AVX-512 BF16 (the bf16 entry points answer -2 where not).
        self.has_bf16 = self._rows_bf16(GGUF_FORMATS["Q8_0"].type_id, None, 0, 32, 0, None, 0, 1) != -2
        # The types the int8 tiles take (`INT8_TILE_TYPES`, Q4_0 on VNNI) from how many tokens: the library's rule.
        min_tokens = lib.gguf_int8_tile_min_tokens
        min_tokens.restype, min_tokens.argtypes = ctypes.c_int, [i32]
        self.int8_tile_min_tokens = {name: n for name, fmt in GGUF_FORMATS.items() if (n := min_tokens(fmt.type_id))}

    int8_tile_types = property(lambda self: frozenset(self.int8_tile_min_tokens))  # both follow the rule
    has_int8_tiles = property(lambda self: bool(self.int8_tile_min_tokens))

    def int8_tiles_take(self, qtype: str, tokens: int) -> bool:
        """Whether `tokens` tokens of 16-bit activations times `qtype` rows take the int8 tiles."""
        return tokens >= self.int8_tile_min_tokens.get(qtype, tokens + 1)

    def gemm(self, qtype: str, blocks: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
             int8_activations: bool = False) -> bool:
        """out [m, rows] (float32; rows contiguous, any row stride) = x [m, k] float32
        (rows contiguous) times the blocks' rows [rows, row_bytes] (contiguous). With
        `int8_activations`, x is quantised to int8 first (VNNI or AVX2) and out may also
        be bfloat16 or float16; False, with nothing written, where this build has neither."""
        if int8_activations:
            return self.gemm_shards(ShardPlan([(qtype, blocks)]), k, x, out)
        status = self._gemm(GGUF_FORMATS[qtype].type_id, blocks.data_ptr(), blocks.shape[0], k, blocks.stride(0),
                            x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(), out.stride(0),
                            torch.get_num_threads())
        if status:
            raise ValueError(f"GGUF kernel: unknown type {qtype}")
        return True

    def gemm_shards(self, plan: ShardPlan, k: int, x: torch.Tensor, out: torch.Tensor) -> bool:
        """out [m, plan.rows] (float32, bfloat16 or float16, each output rounded once;
        rows contiguous, any row stride) = x [m, k] (float32, bfloat16 or float16; rows
        contiguous) times the plan's shards' rows, shard after shard, with x quantised
        to int8 (VNNI or AVX2). False, with nothing written, where this build has neither."""
        status = self._shards(len(plan.qtypes), plan.qtypes, plan.pointers, plan.rows_per_shard, plan.row_bytes, k,
                              x.data_ptr(), _X_DTYPES[x.dtype], x.stride(0), x.shape[0], out.data_ptr(),
                              _X_DTYPES[out.dtype], out.stride(0), torch.get_num_threads())
        return _succeeded(status, plan.names, "the quantised activations")

    def gemm_shards_bf16(self, plan: ShardPlan, k: int, x: torch.Tensor, out: torch.Tensor) -> bool:
        """out [m, plan.rows] (as gemm_shards') = x [m, k] (bfloat16, rows contiguous)
        times the plan's shards' rows, each 4-row tile dequantised to bfloat16 and
        multiplied by our bf16 register tile. False, with nothing written, where this
        build has no AVX-512 BF16."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"gemm_shards_bf16 takes bfloat16 activations, not {x.dtype}")
        status = self._bf16(len(plan.qtypes), plan.qtypes, plan.pointers, plan.rows_per_shard, plan.row_bytes, k,
                            x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(), _X_DTYPES[out.dtype],
                            out.stride(0), torch.get_num_threads())
        return _succeeded(status, plan.names, "a dequantised tile")

    def gemm_shards_int8_tiles(self, plan: ShardPlan, k: int, x: torch.Tensor, out: torch.Tensor) -> bool:
        """out [m, plan.rows] (as gemm_shards') = x [m, k] (bfloat16 or float16, rows
        contiguous) times the plan's shards (`int8_tile_types`), x quantised to
        int8 per 32 values and each 16-row tile of the weight unpacked to bytes. False,
        with nothing written, where this build has neither AVX-512 VNNI nor
        AVX2."""
        status = self._int8_tiles(len(plan.qtypes), plan.qtypes, plan.pointers, plan.rows_per_shard, plan.row_bytes,
                                  k, x.data_ptr(), _X_DTYPES[x.dtype], x.stride(0), x.shape[0], out.data_ptr(),
                                  _X_DTYPES[out.dtype], out.stride(0), torch.get_num_threads())
        if status == -1:
            raise ValueError(f"GGUF int8 tiles take {sorted(self.int8_tile_types)} rows and 16-bit activations, "
                             f"not {plan.names} and {x.dtype}")
        return _succeeded(status, plan.names, "the quantised activations or a tile")

    def dequantize_rows_bf16(self, qtype: str, blocks: torch.Tensor, k: int, out: torch.Tensor) -> bool:
        """out [n, k] bfloat16 (rows contiguous) = every row of `blocks`, rounded once to
        bfloat16 (nearest even, as `.to(torch.bfloat16)` rounds). False, with nothing
        written, where this build has no AVX-512 BF16."""
        status = self._rows_bf16(GGUF_FORMATS[qtype].type_id, blocks.data_ptr(), blocks.stride(0), k, blocks.shape[0],
                                 out.data_ptr(), out.stride(0), torch.get_num_threads())
        return _succeeded(status, [qtype], "")

    def dequantize_rows(self, qtype: str, blocks: torch.Tensor, k: int, ids: torch.Tensor | None,
                        out: torch.Tensor) -> None:
        """out [n, k] float32 (rows contiguous) = rows `ids` (int64, contiguous; None: all)."""
        n = blocks.shape[0] if ids is None else ids.numel()
        status = self._rows(GGUF_FORMATS[qtype].type_id, blocks.data_ptr(), blocks.stride(0), k,
                            None if ids is None else ids.data_ptr(), n, out.data_ptr(), out.stride(0),
                            torch.get_num_threads())
        if status:
            raise ValueError(f"GGUF kernel: unknown type {qtype}")


def _succeeded(status: int, names: list[str], scratch: str) -> bool:
    """A C entry point's status: True (0), False (-2: this build lacks the instructions),
    or the error: MemoryError (-3: no memory for `scratch`), ValueError (-1: a type among
    `names` that the library does not know)."""
    if status == -2:
        return False
    if status == -3:
        raise MemoryError(f"GGUF kernel: no memory for {scratch}")
    if status:
        raise ValueError(f"GGUF kernel: unknown type among {names}")
    return True


@functools.cache
def load() -> GGUFKernels | None:
    """The kernels, built if this machine has none cached; None where they cannot be (the
    reason is logged once) or `TP_CPU_GGUF_KERNELS=0`: then the torch path computes."""
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBS, GGUFKernels,
                       "GGUF CPU kernels unavailable (%s); GGUF layers dequantise per call in torch",
                       switch="TP_CPU_GGUF_KERNELS")


@functools.cache
def _triton_gemm() -> Callable[..., None] | None:
    """`gguf_matmul_triton`, or None where the triton package cannot be imported (logged
    once): then CUDA layers dequantise per call in torch."""
    try:
        from models.layers.quantization.kernels.gguf_triton import gguf_matmul_triton
    except ImportError as e:
        logger.warning("GGUF Triton kernel unavailable (%s); GGUF layers on CUDA dequantise per call in torch", e)
        return None
    return gguf_matmul_triton


def _kernel_for(blocks: torch.Tensor, qtype: str) -> GGUFKernels | None:
    if blocks.device.type != "cpu" or qtype in FLOAT_TYPES or not blocks.is_contiguous():
        return None
    return load()


def gguf_linear(qtype: str, blocks: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor) -> None:
    """out [m, rows] (a view whose rows are contiguous: a shard's columns of the layer's
    output; float32, or x's 16-bit dtype, each output rounded once from its float sum) =
    x [m, k] W^T, W the `qtype` rows `blocks` [rows, row_bytes]. Activations in a 16-bit
    dtype go through int8 (`INT8_ACTIVATION_DTYPES`)."""
    if blocks.is_cuda and qtype not in FLOAT_TYPES and (triton_gemm := _triton_gemm()) is not None:
        triton_gemm(qtype, blocks, k, x, out)
        return
    kernel = _kernel_for(blocks, qtype)
    if kernel is None:
        weight = dequantize(qtype, blocks, k)
        out.copy_(x.float() @ weight.t())
        return
    half = x.dtype in INT8_ACTIVATION_DTYPES
    m, rows = x.shape[0], blocks.shape[0]
    if half and kernel.int8_tiles_take(qtype, m) and _int8_tiles(kernel, ShardPlan([(qtype, blocks)]), k, x, out):
        return
    if half and BF16_TILE_MIN_TOKENS <= m <= BF16_TILE_MAX_TOKENS and _bf16_tiles(
            kernel, ShardPlan([(qtype, blocks)]), k, x, out):
        return
    if m <= SMALL_BATCH_TOKENS:
        if out.stride(1) != 1:
            raise ValueError("gguf_linear: the output's rows must be contiguous")
        x = x.float().contiguous()
        if half and kernel.gemm(qtype, blocks, k, x, out, int8_activations=True):
            return
        exact = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
        kernel.gemm(qtype, blocks, k, x, exact)
        if exact is not out:
            out.copy_(exact)
        return
    # 16-bit activations multiply a 16-bit copy of each tile where the CPU has a GEMM for
    # their dtype (AVX-512 BF16/FP16, AMX: 2.4x the float32 one at 128 tokens,
    # 2026-12-05); elsewhere (AVX2), where torch's 16-bit GEMM converts as it goes, and for
    # float32 activations, the float32 GEMM (exact for float32 x). A bf16 tile is
    # dequantised straight to bf16 where the build can (the same values: one rounding to
    # nearest even), skipping a float32 tile and its conversion.
    half_gemm = half and not lacks_native_gemm(x)
    x = x.contiguous() if half_gemm else x.float().contiguous()
    direct = x.dtype == torch.bfloat16 and kernel.has_bf16
    tile = torch.empty(min(TILE_ROWS, rows), k, dtype=torch.bfloat16 if direct else torch.float32)
    for r0 in range(0, rows, TILE_ROWS):
        n = min(TILE_ROWS, rows - r0)
        if direct:
            kernel.dequantize_rows_bf16(qtype, blocks[r0:r0 + n], k, tile[:n])
        else:
            kernel.dequantize_rows(qtype, blocks[r0:r0 + n], k, None, tile[:n])
        out[:, r0:r0 + n].copy_(x @ (tile[:n].to(x.dtype) if half_gemm else tile[:n]).t())


def shard_plan(shards: list[tuple[str, torch.Tensor]]) -> ShardPlan | None:
    """A layer's shards as one `gguf_linear_shards` call, or None where that path cannot
    take them (a shard held as floats, off the CPU, or not contiguous)."""
    if any(_kernel_for(blocks, qtype) is None for qtype, blocks in shards):
        return None
    return ShardPlan(shards)


def gguf_linear_shards(plan: ShardPlan | None, k: int, x: torch.Tensor, out: torch.Tensor) -> bool:
    """out [m, plan.rows] (float32 or x's dtype, rows contiguous) = x [m, k] times every
    shard of `plan` in one C call, for 16-bit activations (`INT8_ACTIVATION_DTYPES`): the
    int8 tiles' (where they take every shard), the bf16 tiles' (up to `BF16_TILE_MAX_TOKENS`)
    and the int8 rows' (up to `SMALL_BATCH_TOKENS`); the same values as `gguf_linear` shard
    by shard. False, with nothing written, where none applies or the shards' paths differ."""
    if plan is None or x.dtype not in INT8_ACTIVATION_DTYPES:
        return False
    kernel = load()
    if kernel is None:
        return False
    if out.stride(1) != 1:
        raise ValueError("gguf_linear_shards: the output's rows must be contiguous")
    if _int8_tiles(kernel, plan, k, x, out):
        return True
    if x.shape[0] > BF16_TILE_MAX_TOKENS or any(  # tile types among others: int8 tiles shard by shard
            kernel.int8_tiles_take(name, x.shape[0]) for name in plan.names):
        return False
    if _bf16_tiles(kernel, plan, k, x, out):
        return True
    if x.shape[0] > SMALL_BATCH_TOKENS:
        return False
    return kernel.gemm_shards(plan, k, x if x.stride(1) == 1 else x.contiguous(), out)


def _int8_tiles(kernel: GGUFKernels, plan: ShardPlan, k: int, x: torch.Tensor, out: torch.Tensor) -> bool:
    """The int8 tiles' product of 16-bit x into out (float32 or x's dtype, rows contiguous)
    where they take every shard at x's token count (`GGUFKernels.int8_tiles_take`); False,
    with nothing written, otherwise."""
    # (the tiles walk whole 256-value runs: Q4_0/Q8_0 rows of other widths take the other paths)
    if not (out.stride(1) == 1 and k % 256 == 0 and all(kernel.int8_tiles_take(n, x.shape[0]) for n in plan.names)):
        return False
    return kernel.gemm_shards_int8_tiles(plan, k, x if x.stride(1) == 1 else x.contiguous(), out)


def _bf16_tiles(kernel: GGUFKernels, plan: ShardPlan, k: int, x: torch.Tensor, out: torch.Tensor) -> bool:
    """The dequantised-bf16-tile product for BF16_TILE_MIN_TOKENS..BF16_TILE_MAX_TOKENS
    tokens of 16-bit x into out (float32 or x's dtype, rows contiguous); False, with
    nothing written, for other token counts or where the build has no AVX-512 BF16."""
    if not (kernel.has_bf16 and BF16_TILE_MIN_TOKENS <= x.shape[0] <= BF16_TILE_MAX_TOKENS and out.stride(1) == 1):
        return False
    x = x.to(torch.bfloat16)
    return kernel.gemm_shards_bf16(plan, k, x if x.stride(1) == 1 else x.contiguous(), out)


def gguf_dequantize_rows(qtype: str, blocks: torch.Tensor, k: int, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids), k] float32: the rows `ids` (int64) of the `qtype` rows `blocks`."""
    kernel = _kernel_for(blocks, qtype)
    if kernel is None:
        return dequantize(qtype, blocks[ids], k)
    ids = ids.contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    kernel.dequantize_rows(qtype, blocks, k, ids, out)
    return out
