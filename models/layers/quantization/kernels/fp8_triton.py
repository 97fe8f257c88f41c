"""The CUDA kernel of fp8 weight layers: one Triton GEMM that reads the fp8 bytes.

`fp8_matmul_triton(x, weight, scale, block_n, block_k, out)` computes out = x
dequant(weight)^T, dequant(weight)[r, c] = weight[r, c] * scale[r // block_n, c //
block_k], for every scale shape `fp8_kernels.fp8_linear` takes: 128x128 blocks
(DeepSeek-V3, Qwen3-FP8, compressed-tensors "block"), per channel (block_n = 1,
block_k = in) and per tensor made per channel. Each program computes a [BLOCK_M
tokens, BLOCK_N rows] tile of out, walking the inputs BLOCK_K at a time: it loads those
weight bytes, decodes e4m3fn from their bits (sign, 4 exponent bits biased by 7, 3
mantissa bits, subnormals, NaN at 0x7F/0xFF) so that no GPU generation's fp8
conversion support matters, multiplies by the scales in float32 (as the CPU tiles do),
rounds once to x's dtype and adds one `tl.dot`, accumulating in float32. Each output
is rounded once, to `out`'s dtype. The weight is read once per token tile at one byte
a value; nothing is allocated.

Activations stay in their 16-bit dtype (weight-only, W8A16): vLLM's block-fp8 kernel
quantises them to fp8 per 128 values, which is faster on fp8 tensor cores and less
accurate; per-channel layers with dynamic activations keep `torch._scaled_mm` where the
GPU has it (compute capability >= 8.9) and come here elsewhere. Tested on the CPU under
Triton's interpreter (TRITON_INTERPRET=1); its speed on a GPU has not been measured.
Called from `fp8_linear` on every rank for weights on a CUDA device.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (read, as Triton reads it, when this module is imported) runs
# bfloat16 products wrong: there the rounded operands are upcast to float32 for the dot.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _e4m3fn_to_f32(q):
    """float8_e4m3fn bytes (uint8) -> float32, from the bits."""
    b = q.to(tl.int32)
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)  # bias 127 - 7; 3 of float32's 23 mantissa bits
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125,  # subnormal: m * 2^-9
                         normal.to(tl.float32, bitcast=True))
    magnitude = tl.where((exponent == 15) & (mantissa == 7), float("nan"), magnitude)
    return tl.where((b & 128) != 0, -magnitude, magnitude)


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                     block_n, block_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     IEEE: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    safe_n = tl.where(n_mask, offs_n, 0).to(tl.int64)
    w_rows = w_ptr + safe_n[:, None] * stride_wn
    s_rows = s_ptr + (safe_n // block_n)[:, None] * stride_sn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        q = tl.load(w_rows + kk[None, :], mask=w_mask, other=0)
        s = tl.load(s_rows + (kk // block_k)[None, :], mask=w_mask, other=0.0)
        xb = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = (_e4m3fn_to_f32(q) * s).to(xb.dtype)
        if UPCAST:
            xb = xb.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(xb, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xb, tl.trans(w))
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_matmul_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                      out: torch.Tensor, block_m: int = 16, block_n_tile: int = 64, block_k_tile: int = 64) -> None:
    """out [m, out_features] (any float dtype, rows contiguous) = x [m, in] (float32,
    bfloat16 or float16) times dequant(weight)^T; weight [out, in] float8_e4m3fn (or its
    bytes as uint8) with contiguous rows, scale [ceil(out / block_n), ceil(in /
    block_k)] (float32 or 16-bit). Every tensor on one device (CUDA; the CPU under
    TRITON_INTERPRET=1). Raises ValueError for shapes that disagree."""
    m, (n, k) = x.shape[0], weight.shape
    rows, cols = -(-n // block_n), -(-k // block_k)
    if (weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or weight.stride(1) != 1
            or tuple(scale.shape) != (rows, cols) or x.shape[1] != k or out.shape != (m, n) or out.stride(1) != 1):
        raise ValueError(f"fp8_matmul_triton: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"scale {tuple(scale.shape)} for blocks of {block_n}x{block_k} and out "
                         f"{tuple(out.shape)} do not fit")
    if m == 0 or n == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    scale = scale.to(torch.float32)
    if scale.stride(1) != 1:
        scale = scale.contiguous()
    upcast = _INTERPRETED or x.device.type == "cpu"
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n_tile))
    _fp8_gemm_kernel[grid](x, weight.view(torch.uint8), scale, out, m, n, k, x.stride(0), weight.stride(0),
                           scale.stride(0), out.stride(0), block_n, block_k, BLOCK_M=block_m,
                           BLOCK_N=block_n_tile, BLOCK_K=block_k_tile, IEEE=x.dtype == torch.float32 or upcast,
                           UPCAST=upcast)
