"""Block-quantised fp8 experts: a native fp8 checkpoint's mixture-of-experts layers, as
Qwen3-MoE-FP8 and DeepSeek ship them (vLLM's `Fp8MoEMethod` for block scales).

Each expert's gate, up and down projections are stored like a dense fp8 block layer's
(fp8_checkpoint.py): `weight` [out, in] float8_e4m3fn and `weight_scale_inv`
[ceil(out/bn), ceil(in/bk)] float32, the factor that multiplies q back. The method
registers them stacked, in the FusedMoE layout and counted in blocks:

- `w13_weight` [E_local, 2I, H] e4m3 and `w13_weight_scale_inv` [E_local, 2I/bn,
  ceil(H/bk)]: each expert's gate rows, then its up rows;
- `w2_weight` [E_local, H, I] e4m3 and `w2_weight_scale_inv` [E_local, ceil(H/bn),
  ceil(I/bk)];

with I this rank's intermediate width (sliced under tensor parallelism, whole under
expert parallelism). The gate and up halves meet in w13 on a block boundary, so I must
be a multiple of bn, and a rank's slice of w2's inputs whole blocks (I a multiple of
bk under TP); `create_weights` raises ValueError naming weight_block_size,
moe_intermediate_size and tensor_parallel_size otherwise (as vLLM refuses such a TP
size). The weights stay fp8 in memory: one byte a weight plus the scales.

Compute: the experts' tokens are grouped as for full-precision experts
(`grouped_moe.grouped_experts`: one product pair per active expert), each product
`fp8_kernels.fp8_linear` on the expert's fp8 bytes and block scales (the C GEMV for a
few tokens, dequantised tiles for more on the CPU; the Triton fp8 GEMM on CUDA). The
grouping reads the per-expert counts on the host, so a step with these experts is not
recorded as a CPU graph, nor captured as a CUDA graph (`supports_cuda_graphs`): it runs
eagerly. Activations stay in the model's dtype (the checkpoint's dynamic fp8
activations are not applied, as for the dense fp8 layers). Called by `FusedMoE.forward`
on every rank with this rank's experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.layers.fused_moe.grouped_moe import grouped_experts
from models.layers.fused_moe.moe_method import FusedMoEMethodBase, expert_parameter
from models.layers.quantization.fp8 import FP8_DTYPE
from models.layers.quantization.fp8_kernels import fp8_linear


class Fp8MoEMethod(FusedMoEMethodBase):
    """fp8 experts with (block_n, block_k) block scales (see the module docstring)."""

    supports_cuda_graphs = False  # the grouping reads the per-expert counts on the host

    def __init__(self, block: tuple[int, int], block_field: str = "weight_block_size") -> None:
        self.block, self.block_field = block, block_field

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_per_rank: int, params_dtype: torch.dtype) -> None:
        block_n, block_k = self.block
        sliced = getattr(layer, "slice_intermediate", False)
        if intermediate_per_rank % block_n or (sliced and intermediate_per_rank % block_k):
            setting = f"quantization_config.{self.block_field}={[block_n, block_k]}"
            full = getattr(layer, "intermediate_size", intermediate_per_rank)
            if not sliced:
                raise ValueError(f"{setting} does not divide the experts: moe_intermediate_size={full} is not a "
                                 f"multiple of the block's {block_n} rows, so the gate and up halves stacked in "
                                 "w13 would share a scale block")
            raise ValueError(f"{setting} does not divide the experts' slices at tensor_parallel_size="
                             f"{getattr(layer, 'tp_size', 1)}: moe_intermediate_size={full} leaves "
                             f"{intermediate_per_rank} per rank, not whole scale blocks; use a tensor_parallel_size "
                             "that does, or expert parallelism (whole experts per rank)")
        experts, hidden, inter = num_local_experts, hidden_size, intermediate_per_rank
        expert_parameter(layer, "w13_weight", (experts, 2 * inter, hidden), FP8_DTYPE, "weight")
        expert_parameter(layer, "w2_weight", (experts, hidden, inter), FP8_DTYPE, "weight")
        expert_parameter(layer, "w13_weight_scale_inv", (experts, 2 * inter // block_n, -(-hidden // block_k)),
                         torch.float32, "weight_scale_inv", self.block)
        expert_parameter(layer, "w2_weight_scale_inv", (experts, -(-hidden // block_n), -(-inter // block_k)),
                         torch.float32, "weight_scale_inv", self.block)

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        block_n, block_k = self.block
        w13, w2 = layer.w13_weight, layer.w2_weight
        s13, s2 = layer.w13_weight_scale_inv, layer.w2_weight_scale_inv
        return grouped_experts(x, topk_weights, topk_ids, layer.expert_map, w13.shape[0], w2.shape[2],
                               lambda e, rows: fp8_linear(rows, w13[e], s13[e], block_n, block_k),
                               lambda e, act: fp8_linear(act, w2[e], s2[e], block_n, block_k))
