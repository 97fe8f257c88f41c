"""W8A8 int8 experts: mixture-of-experts layers of compressed-tensors W8A8 checkpoints
(llm-compressor's W8A8 recipe, as RedHatAI's Qwen3-MoE `quantized.w8a8` ship); vLLM's
`CompressedTensorsW8A8Int8MoEMethod`.

Each expert's gate, up and down projections are stored like a dense W8A8 layer's
(compressed_tensors/schemes/w8a8_int8.py): `weight` [out, in] int8, symmetric, and
`weight_scale` [out, 1] per channel, or one value per projection (strategy "tensor",
which vLLM refuses for experts; held as the per-channel scale it equals, widened as it
loads). The method registers them stacked, in the FusedMoE layout, as the checkpoint
holds them (no repacking: one byte a weight plus a float32 scale per row):

- `w13_weight` [E_local, 2I, H] int8 and `w13_weight_scale` [E_local, 2I, 1]: each
  expert's gate rows, then its up rows;
- `w2_weight` [E_local, H, I] int8 and `w2_weight_scale` [E_local, H, 1] (whole on every
  rank: one scale per output row);

with I this rank's intermediate width (sliced under tensor parallelism, whole under
expert parallelism).

Compute, as the dense W8A8 layers and vLLM's int8 experts do: each product's input is
quantised to int8 per token, dynamically (the layer's tokens, then each expert's
silu(gate) * up), and meets the int8 weight in exact int32 sums, scaled by the token's
and the row's scales. Under tensor parallelism each rank quantises its own slice of the
activations before w2, with its own per-token scale, as a row-parallel layer does. On
the CPU a decode step (up to `MAX_KERNEL_TOKENS` tokens, float32 or bfloat16) runs in
one C call (kernels/int8_moe.c: the pairs sorted by expert; with AVX-512 VNNI every
active expert's row blocks shared out over the threads as they finish, on int8_cpu.c's
register tiles; with AVX2 alone each expert's products through int8_cpu.c's GEMM in
turn), which reads the routing from tensors, so the step records and replays as a CPU
graph. Otherwise (a prefill, float16, CUDA) the
experts' tokens are grouped as for full-precision experts (`grouped_moe.grouped_experts`:
one product pair per active expert, a host read of the counts, eager), each product
int8_gemm.py's `int8_linear` (torch._int_mm: oneDNN's int8 GEMM on VNNI or AMX CPUs,
cuBLASLt's on CUDA). No CUDA graph captures these layers (`supports_cuda_graphs`).
Called by `FusedMoE.forward` on every rank with this rank's experts.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from models.layers.fused_moe.grouped_moe import grouped_experts
from models.layers.fused_moe.moe_method import (
    MAX_KERNEL_TOKENS,
    FusedMoEMethodBase,
    bind_one_call,
    expert_parameter,
    one_call_applies,
    one_call_experts,
)
from models.layers.quantization.int8_gemm import int8_linear, load, quantize_per_token
from models.layers.quantization.per_tensor_scales import per_tensor_as_rows

_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # int8_moe.c's x_dtype

_STACK = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
#: int8_moe.c's weight arguments: each stack's int8 weights and scales with their strides, H, I
_WEIGHT_ARGTYPES = (*_STACK, *_STACK, ctypes.c_int64, ctypes.c_int64)


def _w8a8_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, K] through one expert's int8 weight [N, K] and scale [N, 1], x quantised per
    token: [n, N] in x's dtype."""
    xq, x_scale = quantize_per_token(x)
    return int8_linear(xq, x_scale, weight, scale, None, x.dtype)


class Int8MoEMethod(FusedMoEMethodBase):
    """int8 experts with dynamic per-token int8 activations; `per_tensor`: the checkpoint
    gives one scale per projection (see the module docstring)."""

    supports_cuda_graphs = False  # the grouping reads the per-expert counts on the host

    def __init__(self, per_tensor: bool = False) -> None:
        self.per_tensor = per_tensor

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_per_rank: int, params_dtype: torch.dtype) -> None:
        experts, hidden, inter = num_local_experts, hidden_size, intermediate_per_rank
        full = getattr(layer, "intermediate_size", inter)
        expert_parameter(layer, "w13_weight", (experts, 2 * inter, hidden), torch.int8, "weight")
        expert_parameter(layer, "w2_weight", (experts, hidden, inter), torch.int8, "weight")
        # a scale covers one row of the whole input; a projection's one value is widened to its
        # rows (w13's gate or up: the whole intermediate width) before the loader takes this rank's
        expert_parameter(layer, "w13_weight_scale", (experts, 2 * inter, 1), torch.float32, "weight_scale",
                         (1, hidden), per_tensor_as_rows(full) if self.per_tensor else None)
        expert_parameter(layer, "w2_weight_scale", (experts, hidden, 1), torch.float32, "weight_scale",
                         (1, full), per_tensor_as_rows(hidden) if self.per_tensor else None)

    def _weight_args(self, layer: Any) -> list[Any]:
        """int8_moe.c's weight arguments: each stack's weights and scales with their strides
        (elements), then H and I."""
        args: list[Any] = []
        for prefix in ("w13", "w2"):
            w, s = getattr(layer, f"{prefix}_weight"), getattr(layer, f"{prefix}_weight_scale")
            args += [w.data_ptr(), w[0].numel(), s.data_ptr(), s[0].numel()]
        return [*args, layer.w2_weight.shape[1], layer.w2_weight.shape[2]]

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        s13, s2 = layer.w13_weight_scale, layer.w2_weight_scale
        if (one_call_applies(x, _X_DTYPES, MAX_KERNEL_TOKENS) and (kernel := load()) is not None
                and kernel.has_gemm):
            entry = bind_one_call(kernel.lib, "int8_moe", _WEIGHT_ARGTYPES)
            y = one_call_experts(entry, self._weight_args(layer), x, _X_DTYPES[x.dtype], topk_weights, topk_ids,
                                 layer.expert_map, layer.num_experts, w13.shape[0], "int8 experts")
            if y is not None:
                return y.to(x.dtype)
        return grouped_experts(x, topk_weights, topk_ids, layer.expert_map, w13.shape[0], w2.shape[2],
                               lambda e, rows: _w8a8_product(rows, w13[e], s13[e]),
                               lambda e, act: _w8a8_product(act, w2[e], s2[e]))
