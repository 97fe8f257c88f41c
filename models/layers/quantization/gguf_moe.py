"""GGUF experts: a mixture of experts' layers of a llama.cpp file (qwen3moe) kept in their
block formats, as the dense GGUF layers are (gguf.py); vLLM's `GGUFMoEMethod`.

The file stacks each layer's experts: `blk.N.ffn_gate_exps` / `ffn_up_exps` [E, I, H]
and `ffn_down_exps` [E, H, I] (rows of GGUF blocks along the last dimension), which the
GGUF iterator (model_loader/gguf_utils.py) hands over one expert at a time as
`experts.<e>.<proj>.qweight`, that expert's [rows, row_bytes] bytes. The method holds
them stacked, as the file's blocks, each row a run of blocks ([E, rows, blocks per row,
bytes per block], so that the loader slices whole blocks):

    w13_qweight  uint8 [E_local, 2I, H / qk13, bytes13]  each expert's gate rows, then its up
                                                         rows (one type: the file's gate and
                                                         up types must agree)
    w2_qweight   uint8 [E_local, H, I / qk2, bytes2]     its down rows, this rank's blocks

with I this rank's intermediate width: tensor parallelism slices w13's rows and w2's
blocks (I / tensor_parallel_size must be whole blocks of the down type: 256 values for
the K-quants; otherwise `create_weights` raises naming tensor_parallel_size, and expert
parallelism, whole experts per rank, serves); its bytes are this rank's share of the
file's. The types come per layer from the GGUF config's `tensor_types`
(`model.layers.N.mlp.experts.gate_proj` ...), so a FusedMoE gets this method once the
loader knows its name (`GGUFConfig.selects_moe_by_name`).

Compute, on the CPU: a decode step of 16-bit activations (up to `MAX_KERNEL_TOKENS`
tokens) in one C call (gguf_moe.c: the pairs sorted by expert, every active expert's
tokens through the dense GGUF layers' int8 products, one parallel loop for all gate/up
rows and one for all down rows, gate/up and the activation kept in float32), which
reads the routing from tensors, so the step records and replays as a CPU graph.
Otherwise (a prefill, float32 activations, CUDA) the tokens are grouped per expert in
torch (`grouped_moe.grouped_experts`: a host read of the per-expert counts, eager) and
each product is the dense layers' (`gguf_linear`: int8 products or tiles of
16-bit activations, float products of float32 ones, through each expert's kernel plan,
built once). No CUDA graph captures these layers (`supports_cuda_graphs`). Called by
`FusedMoE.forward` on every rank with this rank's experts.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
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
from models.layers.quantization.gguf_dequant import GGUF_FORMATS, dequantize
from models.layers.quantization.gguf_kernels import (
    INT8_ACTIVATION_DTYPES,
    ShardPlan,
    gguf_linear,
    gguf_linear_shards,
    load,
)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_X_DTYPES = {torch.bfloat16: 1, torch.float16: 2}  # gguf_moe.c's x_dtype (0, float32, takes the grouped path)


_STACK = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
#: gguf_moe.c's weight arguments: each stack's type, bytes, expert and row strides, H, I
_WEIGHT_ARGTYPES = (*_STACK, *_STACK, ctypes.c_int64, ctypes.c_int64)


def _in_blocks(block_bytes: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An expert's [rows, row_bytes] block bytes as [rows, blocks, block_bytes]."""
    return lambda blocks: blocks.reshape(blocks.shape[0], -1, block_bytes)


class GGUFMoEMethod(FusedMoEMethodBase):
    """Experts held as GGUF blocks: gate and up of type `gate_up_type`, down of
    `down_type` (see the module docstring)."""

    supports_cuda_graphs = False  # the grouping reads the per-expert counts on the host

    def __init__(self, gate_up_type: str, down_type: str) -> None:
        for qtype in (gate_up_type, down_type):
            if qtype not in GGUF_FORMATS:
                raise ValueError(f"GGUF experts of type {qtype} are not supported; supported: {list(GGUF_FORMATS)}")
        self.gate_up_type, self.down_type = gate_up_type, down_type

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_per_rank: int, params_dtype: torch.dtype) -> None:
        up, down = GGUF_FORMATS[self.gate_up_type], GGUF_FORMATS[self.down_type]
        if hidden_size % up.block_size:
            raise ValueError(f"GGUF {self.gate_up_type} experts: hidden_size={hidden_size} is not a whole number of "
                             f"blocks of {up.block_size}")
        if intermediate_per_rank % down.block_size:
            tp = getattr(layer, "tp_size", 1) if getattr(layer, "slice_intermediate", False) else 1
            raise ValueError(f"GGUF {self.down_type} experts: {intermediate_per_rank} intermediate features per rank "
                             f"(moe_intermediate_size={getattr(layer, 'intermediate_size', intermediate_per_rank)}, "
                             f"tensor_parallel_size={tp}) are not whole blocks of {down.block_size}; use a "
                             "tensor_parallel_size that leaves whole blocks, or expert parallelism (whole experts "
                             "per rank)")
        experts = num_local_experts
        expert_parameter(layer, "w13_qweight",
                         (experts, 2 * intermediate_per_rank, hidden_size // up.block_size, up.block_bytes),
                         torch.uint8, "qweight", (1, up.block_size), _in_blocks(up.block_bytes))
        expert_parameter(layer, "w2_qweight",
                         (experts, hidden_size, intermediate_per_rank // down.block_size, down.block_bytes),
                         torch.uint8, "qweight", (1, down.block_size), _in_blocks(down.block_bytes))

    def _plans(self, layer: nn.Module) -> tuple[list[ShardPlan], list[ShardPlan]]:
        """(w13's, w2's) kernel plan per local expert, built on first use and again
        whenever the stacks' storage has moved (sleep and wake), as a dense GGUF layer
        keeps its plan: a decode step builds none."""
        w13, w2 = layer.w13_qweight, layer.w2_qweight
        key = (w13.data_ptr(), w2.data_ptr())
        cached = layer.__dict__.get("_gguf_expert_plans")
        if cached is None or cached[0] != key:
            plans = ([ShardPlan([(self.gate_up_type, w.view(w.shape[0], -1))]) for w in w13],
                     [ShardPlan([(self.down_type, w.view(w.shape[0], -1))]) for w in w2])
            layer.__dict__["_gguf_expert_plans"] = cached = (key, plans)
        return cached[1]

    @staticmethod
    def _product(plan: ShardPlan, qtype: str, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [n, k] times one expert's [rows, blocks, bytes] weight, in x's dtype: in one
        C call through its plan for 16-bit x, else `gguf_linear`."""
        rows = blocks.shape[0]
        out_dtype = x.dtype if x.dtype in _FLOAT_DTYPES else torch.float32
        out = torch.empty(x.shape[0], rows, dtype=out_dtype, device=x.device)
        x = x.contiguous()
        k = x.shape[1]
        if not gguf_linear_shards(plan, k, x, out):
            gguf_linear(qtype, blocks.view(rows, -1), k, x, out)
        return out.to(x.dtype)

    def _weight_args(self, w13: torch.Tensor, w2: torch.Tensor) -> list[Any]:
        """gguf_moe.c's weight arguments: each stack's type, bytes, expert and row strides,
        then H and I."""
        return [GGUF_FORMATS[self.gate_up_type].type_id, w13.data_ptr(), w13[0].numel(), w13[0].numel() // w13.shape[1],
                GGUF_FORMATS[self.down_type].type_id, w2.data_ptr(), w2[0].numel(), w2[0].numel() // w2.shape[1],
                w2.shape[1], w13.shape[1] // 2]

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_qweight, layer.w2_qweight
        if one_call_applies(x, INT8_ACTIVATION_DTYPES, MAX_KERNEL_TOKENS) and (kernel := load()) is not None:
            entry = bind_one_call(kernel.lib, "gguf_moe_q8", _WEIGHT_ARGTYPES)
            y = one_call_experts(entry, self._weight_args(w13, w2), x, _X_DTYPES[x.dtype], topk_weights, topk_ids,
                                 layer.expert_map, layer.num_experts, w13.shape[0], "GGUF experts")
            if y is not None:
                return y.to(x.dtype)
        p13, p2 = self._plans(layer) if x.device.type == "cpu" else ([None] * w13.shape[0], [None] * w2.shape[0])
        return grouped_experts(x, topk_weights, topk_ids, layer.expert_map, w13.shape[0], w13.shape[1] // 2,
                               lambda e, rows: self._product(p13[e], self.gate_up_type, w13[e], rows),
                               lambda e, act: self._product(p2[e], self.down_type, w2[e], act))

    def dequantized_weights(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E_local, 2I, H], w2 [E_local, H, I]) as float32 values: for tests and
        inspection (new tensors of the full-precision experts' size)."""
        w13, w2 = layer.w13_qweight, layer.w2_qweight
        hidden = w2.shape[1]
        inter = w13.shape[1] // 2
        return (torch.stack([dequantize(self.gate_up_type, w.reshape(w.shape[0], -1), hidden) for w in w13]),
                torch.stack([dequantize(self.down_type, w.reshape(w.shape[0], -1), inter) for w in w2]))
