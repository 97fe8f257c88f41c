"""fp8 experts: mixture-of-experts layers of native fp8 checkpoints (block scales, as
Qwen3-MoE-FP8 and DeepSeek ship them) and of compressed-tensors FP8 ones (per channel or
in blocks, llm-compressor's FP8_DYNAMIC and FP8_BLOCK); vLLM's `Fp8MoEMethod` and
`CompressedTensorsW8A8Fp8MoEMethod`.

Each expert's gate, up and down projections are stored like a dense fp8 layer's
(fp8_checkpoint.py): `weight` [out, in] float8_e4m3fn and its float32 scale, the factor
that multiplies q back: `weight_scale_inv` (native) or `weight_scale`
(compressed-tensors), [ceil(out/bn), ceil(in/bk)] in blocks, [out, 1] per channel, or
one value per tensor (native fp8 without `weight_block_size`, compressed-tensors FP8
"tensor"), which is held as the per-channel scale it equals (widened as it loads).
The method registers them stacked, in the FusedMoE layout (scales counted in blocks):

- `w13_weight` [E_local, 2I, H] e4m3 and `w13_<scale>` [E_local, 2I/bn, ceil(H/bk)] or
  [E_local, 2I, 1]: each expert's gate rows, then its up rows;
- `w2_weight` [E_local, H, I] e4m3 and `w2_<scale>` [E_local, ceil(H/bn), ceil(I/bk)]
  or [E_local, H, 1] (whole on every rank: one scale per output row);

with I this rank's intermediate width (sliced under tensor parallelism, whole under
expert parallelism). With blocks, the gate and up halves meet in w13 on a block
boundary, so I must be a multiple of bn, and a rank's slice of w2's inputs whole blocks
(I a multiple of bk under TP); `create_weights` raises ValueError naming the block
setting, moe_intermediate_size and tensor_parallel_size otherwise (as vLLM refuses such
a TP size). The weights stay fp8 in memory: one byte a weight plus the scales.

Compute, on the CPU: a decode step (up to `MAX_KERNEL_TOKENS` tokens, float32 or bfloat16)
in one C call (fp8_moe.c: the pairs sorted by expert; bfloat16 tokens on AVX-512 BF16
CPUs: every active expert's rows shared out over the threads in one parallel region,
bfloat16 dot products of the bytes' exact values (fp8_bf16.c), the activation rounded to
bfloat16 between the two products; otherwise each active expert's tokens through the
float32 fp8 GEMV, 16 a call, gate/up and the activation in float32), which reads the
routing from tensors, so the step records and replays as a CPU graph. Otherwise (a prefill, CUDA)
the experts' tokens are grouped as for full-precision experts
(`grouped_moe.grouped_experts`: one product pair per active expert, a host read of the
counts, eager), each product `fp8_kernels.fp8_linear` on the expert's fp8 bytes and
scales (the C GEMV for a few rows, dequantised tiles for more on the CPU; the Triton fp8
GEMM on CUDA). No CUDA graph captures these layers (`supports_cuda_graphs`).
Activations stay in the model's dtype (the checkpoint's dynamic fp8 activations are not
applied, as for the dense fp8 layers). Called by `FusedMoE.forward` on every rank with
this rank's experts.
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
from models.layers.quantization.fp8 import FP8_DTYPE
from models.layers.quantization.fp8_kernels import fp8_linear, load
from models.layers.quantization.per_tensor_scales import per_tensor_as_rows

_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # fp8_moe.c's x_dtype


_STACK = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
          ctypes.c_int64)
#: fp8_moe.c's weight arguments: each stack's bytes and scales (with strides and blocks), H, I
_WEIGHT_ARGTYPES = (*_STACK, *_STACK, ctypes.c_int64, ctypes.c_int64)


class Fp8MoEMethod(FusedMoEMethodBase):
    """fp8 experts with block scales (`strategy` "block", `block` = (block_n, block_k)),
    one scale per output channel ("channel"), or one per projection ("tensor": held as
    the per-channel scale it equals, each row the projection's value, as the dense fp8
    layers hold it), stored under `scale_name` (see the module docstring). `block_field`
    names the checkpoint's block setting in errors."""

    supports_cuda_graphs = False  # the grouping reads the per-expert counts on the host

    def __init__(self, strategy: str, block: tuple[int, int] | None, scale_name: str,
                 block_field: str = "weight_block_size") -> None:
        if strategy not in ("block", "channel", "tensor") or (strategy == "block") != (block is not None):
            raise ValueError(f"fp8 experts with strategy {strategy!r} and block {block!r} are not supported")
        self.strategy, self.block, self.scale_name, self.block_field = strategy, block, scale_name, block_field

    def _check_blocks(self, layer: nn.Module, intermediate_per_rank: int) -> None:
        block_n, block_k = self.block
        sliced = getattr(layer, "slice_intermediate", False)
        if not (intermediate_per_rank % block_n or (sliced and intermediate_per_rank % block_k)):
            return
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

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_per_rank: int, params_dtype: torch.dtype) -> None:
        experts, hidden, inter = num_local_experts, hidden_size, intermediate_per_rank
        if self.block is not None:
            self._check_blocks(layer, inter)
            block_n, block_k = self.block
            shapes = ((experts, 2 * inter // block_n, -(-hidden // block_k)),
                      (experts, -(-hidden // block_n), -(-inter // block_k)))
            blocks = (self.block, self.block)
        else:  # one scale per output row: a "block" of one row by the whole input
            full = getattr(layer, "intermediate_size", inter)
            shapes = ((experts, 2 * inter, 1), (experts, hidden, 1))
            blocks = ((1, hidden), (1, full))
        # per tensor: each projection's one value, widened to its rows as it loads
        transforms = ((per_tensor_as_rows(full), per_tensor_as_rows(hidden)) if self.strategy == "tensor"
                      else (None, None))
        expert_parameter(layer, "w13_weight", (experts, 2 * inter, hidden), FP8_DTYPE, "weight")
        expert_parameter(layer, "w2_weight", (experts, hidden, inter), FP8_DTYPE, "weight")
        expert_parameter(layer, f"w13_{self.scale_name}", shapes[0], torch.float32, self.scale_name, blocks[0],
                         transforms[0])
        expert_parameter(layer, f"w2_{self.scale_name}", shapes[1], torch.float32, self.scale_name, blocks[1],
                         transforms[1])

    def _weight_args(self, layer: Any, blocks: tuple[tuple[int, int], tuple[int, int]]) -> list[Any]:
        """fp8_moe.c's weight arguments: each stack's bytes and scales with their strides and
        blocks, then H and I."""
        args: list[Any] = []
        for prefix, (bn, bk) in zip(("w13", "w2"), blocks):
            w, s = getattr(layer, f"{prefix}_weight"), getattr(layer, f"{prefix}_{self.scale_name}")
            args += [w.data_ptr(), w[0].numel(), s.data_ptr(), s[0].numel(), s.shape[2], bn, bk]
        return [*args, layer.w2_weight.shape[1], layer.w2_weight.shape[2]]

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        s13, s2 = getattr(layer, f"w13_{self.scale_name}"), getattr(layer, f"w2_{self.scale_name}")
        (bn13, bk13), (bn2, bk2) = ((self.block, self.block) if self.block is not None
                                    else ((1, w13.shape[2]), (1, w2.shape[2])))
        if one_call_applies(x, _X_DTYPES, MAX_KERNEL_TOKENS) and (kernel := load()) is not None:
            entry = bind_one_call(kernel.lib, "fp8_moe", _WEIGHT_ARGTYPES)
            y = one_call_experts(entry, self._weight_args(layer, ((bn13, bk13), (bn2, bk2))), x, _X_DTYPES[x.dtype],
                                 topk_weights, topk_ids, layer.expert_map, layer.num_experts, w13.shape[0],
                                 "fp8 experts")
            if y is not None:
                return y.to(x.dtype)
        return grouped_experts(x, topk_weights, topk_ids, layer.expert_map, w13.shape[0], w2.shape[2],
                               lambda e, rows: fp8_linear(rows, w13[e], s13[e], bn13, bk13),
                               lambda e, act: fp8_linear(act, w2[e], s2[e], bn2, bk2))
