"""The CUDA kernel of GGUF layers: one Triton GEMM that reads the file's blocks.

`gguf_matmul_triton(qtype, blocks, k, x, out)` computes out = x W^T for W held as
[rows, row_bytes] blocks of Q4_0, Q8_0, Q4_K, Q5_K or Q6_K (the formats of ggml's
ggml-common.h, as `gguf_dequant.py` reads them). Each program computes a [BLOCK_M
tokens, BLOCK_N rows] tile of out, walking its rows 32 values at a time (a Q4_0/Q8_0
block, or one of a K-quant super-block's eight 32-value groups): it loads those
values' bytes and the scales that apply to them, dequantises a [BLOCK_N, 32] tile in
registers (in float32, in the order `gguf_dequant` computes each value) and adds one
`tl.dot` with the tokens' 32 activations, accumulating in float32. The weight is read
once per token tile at its file size, never dequantised whole; nothing is allocated.
Activations in bfloat16/float16 meet the weights rounded once to their dtype (as
vLLM's GGUF dequantising path multiplies them); float32 activations use IEEE products.
Each output is rounded once, to `out`'s dtype, from its float32 sum.

Why Triton rather than vLLM's approach (CUDA kernels adapted from llama.cpp, int8
dot products on Q8_1 activations): the project's CUDA kernels are Triton, tested on
the CPU under Triton's interpreter (TRITON_INTERPRET=1) and compiled on the GPU.
Its speed on a GPU has not been measured here. Called by `gguf_kernels.gguf_linear`
on every rank for blocks on a CUDA device; `out` may be a shard's columns of a wider
output (its rows contiguous).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from models.layers.quantization.gguf_dequant import row_bytes

# Triton's interpreter (read, as Triton reads it, when this module is imported) runs
# bfloat16 products wrong: there the rounded operands are upcast to float32 for the dot.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

#: The types this kernel reads (their `QTYPE` codes below).
TRITON_TYPES: dict[str, int] = {"Q4_0": 0, "Q8_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}


@triton.jit
def _f16_at(ptr):
    """The little-endian float16 at byte pointers `ptr`, as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8_at(ptr, mask):
    """The int8 values at byte pointers `ptr`, as float32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _dequantize_32(rows, b, offs_l, n_mask, QTYPE: tl.constexpr):
    """[BLOCK_N, 32] float32: values 32*b .. 32*b+31 of the rows starting at byte pointers
    `rows` [BLOCK_N, 1]; masked rows read zeros."""
    mask = n_mask[:, None]
    lane = offs_l[None, :]
    if QTYPE == 0:  # Q4_0: d, then 16 bytes; value l is nibble l // 16 of byte l % 16, minus 8
        base = rows + b * 18
        d = _f16_at(base)
        q = tl.load(base + 2 + lane % 16, mask=mask, other=0).to(tl.int32)
        w = d * (((q >> ((lane // 16) * 4)) & 15) - 8).to(tl.float32)
    elif QTYPE == 1:  # Q8_0: d, then 32 int8 values
        base = rows + b * 34
        w = _f16_at(base) * _i8_at(base + 2 + lane, mask)
    elif QTYPE == 4:  # Q6_K: ql[128], qh[64], 16 int8 scales, d; group j is quarter j % 4 of half j // 4
        j = b % 8
        base = rows + (b // 8) * 210
        half = j // 4
        quarter = j % 4
        low = tl.load(base + 64 * half + 32 * (quarter % 2) + lane, mask=mask, other=0).to(tl.int32)
        high = tl.load(base + 128 + 32 * half + lane, mask=mask, other=0).to(tl.int32)
        q = (((low >> (4 * (quarter // 2))) & 15) | (((high >> (2 * quarter)) & 3) << 4)) - 32
        scale = _i8_at(base + 192 + 8 * half + 2 * quarter + lane // 16, mask)  # one per 16 values
        w = (_f16_at(base + 208) * scale) * q.to(tl.float32)
    else:  # Q4_K / Q5_K: d, dmin, 12 bytes of eight 6-bit (scale, min), [qh[32],] qs[128]
        j = b % 8
        base = rows + (b // 8) * (144 if QTYPE == 2 else 176)
        d = _f16_at(base)
        dmin = _f16_at(base + 2)
        lo4 = j % 4
        s_a = tl.load(base + 4 + lo4).to(tl.int32)      # scales[j] for j < 4, scales[j - 4] after
        s_b = tl.load(base + 8 + lo4).to(tl.int32)      # scales[j + 4] for j < 4, scales[j] after
        s_c = tl.load(base + 12 + lo4).to(tl.int32)     # scales[j + 4] for j >= 4
        first = j < 4
        sc = tl.where(first, s_a & 63, (s_c & 15) | ((s_a >> 6) << 4)).to(tl.float32)
        mn = tl.where(first, s_b & 63, (s_c >> 4) | ((s_b >> 6) << 4)).to(tl.float32)
        qs = base + (16 if QTYPE == 2 else 48) + 32 * (j // 2)
        q = (tl.load(qs + lane, mask=mask, other=0).to(tl.int32) >> (4 * (j % 2))) & 15
        if QTYPE == 3:  # the fifth bit of value l of group j is bit j of qh[l]
            qh = tl.load(base + 16 + lane, mask=mask, other=0).to(tl.int32)
            q = q | (((qh >> j) & 1) << 4)
        w = (d * sc) * q.to(tl.float32) - dmin * mn
    return w


@triton.jit
def _gguf_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, ROW_BYTES, stride_xm, stride_ym,
                      QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                      UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, 32)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = w_ptr + tl.where(n_mask, offs_n, 0).to(tl.int64)[:, None] * ROW_BYTES
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_l[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(K // 32):
        xb = tl.load(x_rows + b * 32, mask=m_mask[:, None], other=0.0)
        w = _dequantize_32(rows, b, offs_l, n_mask, QTYPE).to(xb.dtype)
        if UPCAST:
            xb = xb.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(xb, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xb, tl.trans(w))
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gguf_matmul_triton(qtype: str, blocks: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
                       block_m: int = 16, block_n: int = 64) -> None:
    """out [m, rows] (float32 or x's dtype; a view whose rows are contiguous) = x [m, k]
    (float32, bfloat16 or float16) times W^T, W the `qtype` rows `blocks` [rows,
    row_bytes] uint8 (contiguous). Every tensor on one device (CUDA; the CPU under
    TRITON_INTERPRET=1). Raises ValueError for a type in no `TRITON_TYPES`, or shapes
    that disagree."""
    if qtype not in TRITON_TYPES:
        raise ValueError(f"GGUF type {qtype} has no Triton kernel; it has: {list(TRITON_TYPES)}")
    m, rows, nbytes = x.shape[0], blocks.shape[0], row_bytes(qtype, k)
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.shape[1] != nbytes:
        raise ValueError(f"gguf_matmul_triton: {qtype} rows of {k} values are [rows, {nbytes}] contiguous uint8, "
                         f"got {tuple(blocks.shape)} {blocks.dtype}")
    if x.shape[1] != k or out.shape != (m, rows) or out.stride(1) != 1:
        raise ValueError(f"gguf_matmul_triton: x {tuple(x.shape)} and out {tuple(out.shape)} (rows contiguous) "
                         f"do not fit a [{rows}, {k}] weight")
    if m == 0 or rows == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    upcast = _INTERPRETED or x.device.type == "cpu"
    grid = (triton.cdiv(m, block_m), triton.cdiv(rows, block_n))
    _gguf_gemm_kernel[grid](x, blocks, out, m, rows, k, blocks.shape[1], x.stride(0), out.stride(0),
                            QTYPE=TRITON_TYPES[qtype], BLOCK_M=block_m, BLOCK_N=block_n,
                            IEEE=x.dtype == torch.float32 or upcast, UPCAST=upcast)
