"""int8 activations x int8 weights for W8A8 layers: per-token quantisation and the GEMM.

`quantize_per_token(x)` gives each row of x its own symmetric scale (dynamic: computed
per call, nothing stored). `int8_linear(xq, x_scale, weight, weight_scale, bias,
out_dtype)` computes `(xq @ weight.T) * x_scale * weight_scale (+ bias)` with exact
int32 sums through `torch._int_mm`, which on x86 CPUs is oneDNN's int8 GEMM (AVX-512
VNNI / AMX where the CPU has them) and on CUDA cuBLASLt's. A C kernel of our own with
VNNI `vpdpbusd` (4x4 register tiles) was measured against it on this CPU and lost
(batch 1 from a 4096x4096 weight streamed from memory: 1.0 ms against 0.8 ms on one
thread), so there is none.

Called from the W8A8 int8 scheme's `apply_weights`, on every rank, with this rank's
shard. Memory: the int8 activations and an int32 [M, N] product besides the output.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
_MIN_SCALE = 1e-12  # an all-zero row gets this scale: its values stay exactly 0
_CUDA_INT_MM_MIN_ROWS = 16  # cuBLASLt's int8 GEMM wants more rows than this


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] int8, scale [M] float32) with x ≈ xq * scale[:, None], each row scaled
    so its largest magnitude maps to 127 (round half to even, as torch rounds)."""
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp(min=_MIN_SCALE)
    xq = torch.round(xf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq, scale


def int8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq [M, K] @ weight [N, K]^T) * x_scale [M] * weight_scale [N] (+ bias) in
    `out_dtype`, the integer sums exact and the scaling in float32."""
    m = xq.shape[0]
    if xq.is_cuda and m <= _CUDA_INT_MM_MIN_ROWS:  # decode batches: pad with zero rows
        xq = torch.cat([xq, xq.new_zeros(_CUDA_INT_MM_MIN_ROWS + 1 - m, xq.shape[1])])
    acc = torch._int_mm(xq, weight.t())[:m]
    y = acc.to(torch.float32).mul_(x_scale.reshape(-1, 1)).mul_(weight_scale.reshape(1, -1))
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(out_dtype)
