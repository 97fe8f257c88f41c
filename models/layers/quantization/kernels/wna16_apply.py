"""The WNA16 forward: `apply_wna16(layer, x, bias)` reads the layer's WNA16 layout
(kernels/wna16_layout.py) with the CPU kernels (kernels/wna16_cpu.py) or, on CUDA, the
Triton kernel (kernels/wna16_triton.py), through `wna16_linear(x, layout)`, which also
computes one expert of a FusedMoE; `dequantize_wna16` rebuilds a whole weight for tests.
Above the layout and both kernels, which import only the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.quantization.kernels import wna16_cpu
from models.layers.quantization.kernels.wna16_layout import WNA16Layout, get_wna16_layout


def dequantize_wna16(layout: WNA16Layout) -> torch.Tensor:
    """The whole weight [N, K] float32 in the activations' input order: for tests and
    debugging only (the forward never builds it)."""
    w = torch.empty(layout.out_features, layout.padded_in_features, dtype=torch.float32,
                    device=layout.qweight.device)
    wna16_cpu.dequant_rows_torch(layout, 0, w)
    if layout.input_perm is None:
        return w
    out = torch.zeros(layout.out_features, layout.in_features + 1, dtype=torch.float32, device=w.device)
    out.index_copy_(1, layout.input_perm, w)  # the padding lands in the dropped last column
    return out[:, : layout.in_features]


def apply_wna16(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ bias) from the layer's WNA16 layout (`wna16_linear`). Called from the
    layer's forward on every rank."""
    layout = get_wna16_layout(layer)
    if layout is None:
        raise RuntimeError(f"{type(layer).__name__}: quantised weights used before process_weights_after_loading")
    y = wna16_linear(x, layout)
    if bias is not None:
        y += bias
    return y


def wna16_linear(x: torch.Tensor, layout: WNA16Layout) -> torch.Tensor:
    """y = x W^T for x [..., K] in x's dtype; the products in float32 (bfloat16
    activations over 8 tokens: bfloat16 tiles of W on the CPU). The Triton kernel on
    CUDA, the CPU kernels (`wna16_cpu.wna16_matmul`) otherwise; the activations'
    columns gathered into the layout's input order where it has one. Also one
    expert's product in a FusedMoE (quantization/wna16_moe.py)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from models.layers.quantization.kernels.wna16_triton import wna16_matmul_triton

        y = wna16_matmul_triton(x2, layout)
    else:
        xq = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.to(torch.float32)
        if layout.input_perm is not None:
            xq = F.pad(xq, (0, 1)).index_select(1, layout.input_perm)
        y = wna16_cpu.wna16_matmul(xq.contiguous(), layout, wna16_cpu.load())
    return y.to(x.dtype).reshape(*x.shape[:-1], layout.out_features)
