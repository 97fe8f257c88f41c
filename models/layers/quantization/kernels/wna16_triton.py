"""The CUDA kernel of weight-only int4/int8 layers: one Triton GEMM over the WNA16 layout.

Each program computes a [BLOCK_M tokens, BLOCK_N rows] tile of y = x W^T, walking the
32-input blocks of its rows: it loads a block's codes (16 bytes a row for int4, two
nibbles a byte; 32 for int8), the block's group scale and zero point, dequantises the
two halves of 16 inputs in registers and accumulates two `tl.dot`s in float32. The
weight is read once per token tile at its packed size; nothing else is allocated but
y. Activations in bfloat16/float16 meet weights rounded to their dtype (as vLLM's
GPTQ/AWQ Triton kernels do); float32 activations use IEEE products.

Tested on the CPU under Triton's interpreter (TRITON_INTERPRET=1, tiny shapes); its
speed on a GPU has not been measured here. Called from `apply_wna16`
(kernels/wna16_apply.py) on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if TYPE_CHECKING:
    from models.layers.quantization.kernels.wna16_layout import WNA16Layout


@triton.jit
def _wna16_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bg_ptr, y_ptr, M, N, KP, G, stride_xm, stride_ym,
                       BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 16)
    m_mask = offs_m < M
    n_mask = offs_n < N
    row_bytes = KP * BITS // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(KP // 32):
        g = tl.load(bg_ptr + b)
        s = tl.load(s_ptr + offs_n * G + g, mask=n_mask, other=0.0)
        z = tl.load(z_ptr + offs_n * G + g, mask=n_mask, other=0).to(tl.float32)
        if BITS == 4:
            codes = tl.load(w_ptr + offs_n[:, None] * row_bytes + b * 16 + offs_j[None, :], mask=n_mask[:, None],
                            other=0).to(tl.int32)
            lo = codes & 15
            hi = codes >> 4
        else:
            base = w_ptr + offs_n[:, None] * row_bytes + b * 32 + offs_j[None, :]
            lo = tl.load(base, mask=n_mask[:, None], other=0).to(tl.int32)
            hi = tl.load(base + 16, mask=n_mask[:, None], other=0).to(tl.int32)
        x_base = x_ptr + offs_m[:, None] * stride_xm + b * 32 + offs_j[None, :]
        x_lo = tl.load(x_base, mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_base + 16, mask=m_mask[:, None], other=0.0)
        w_lo = ((lo.to(tl.float32) - z[:, None]) * s[:, None]).to(x_lo.dtype)
        w_hi = ((hi.to(tl.float32) - z[:, None]) * s[:, None]).to(x_hi.dtype)
        if IEEE:
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(x_lo, tl.trans(w_lo))
            acc += tl.dot(x_hi, tl.trans(w_hi))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


def wna16_matmul_triton(x: torch.Tensor, layout: WNA16Layout, block_m: int = 16, block_n: int = 64) -> torch.Tensor:
    """y [M, N] float32 = x [M, K] (any float dtype, on the layout's device) times W^T."""
    if layout.input_perm is not None:
        x = F.pad(x, (0, 1)).index_select(1, layout.input_perm)
    x = x.contiguous()
    m, n = x.shape[0], layout.out_features
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wna16_gemm_kernel[grid](x, layout.qweight, layout.scales, layout.zeros, layout.block_group, y, m, n,
                             layout.padded_in_features, layout.scales.shape[1], x.stride(0), y.stride(0),
                             BITS=layout.bits, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32)
    return y
