"""int4/int8 weight-only experts: mixture-of-experts layers of GPTQ, AWQ and compressed-tensors
W4A16/W8A16 checkpoints (Qwen3-30B-A3B-GPTQ-Int4 and its kind); vLLM's `MoeWNA16Method`
and `CompressedTensorsWNA16MoEMethod`.

Each expert's gate, up and down projections are stored like a dense layer of the same
format (gptq.py, awq.py, compressed_tensors/schemes/wna16.py: N outputs, K inputs,
pack = 32 / bits, G groups of `group_size` inputs, one per row for per-channel). The
method registers them stacked, in the FusedMoE layout, oriented [outputs, inputs] (GPTQ
and AWQ store [inputs, outputs], so their tensors are transposed as they load: the
parameter's `expert_transform`), with I this rank's intermediate width:

    w13_<codes>  int32 [E_local, 2I, H / pack]    codes packed along the inputs (GPTQ
                       or [E_local, 2I / 8, H]    qweight, compressed-tensors
                                                  weight_packed), or along the outputs
                                                  (AWQ's qweight, interleaved)
    w13_<scales> float32 [E_local, 2I, G_H]       scales / weight_scale
    w13_<zeros>  int32 [E_local, 2I / pack, G_H]  qzeros / weight_zero_point, packed along
                                                  the outputs (none for symmetric
                                                  compressed-tensors)

and w2's alike, [E_local, H, ...] over I inputs: each expert's gate rows, then its up
rows, as for full-precision experts. Under tensor parallelism every tensor is sliced
along I (w13's outputs, w2's inputs: whole groups and whole packs per rank; per-channel
scales of w2 whole on every rank); under expert parallelism each rank takes whole
experts. GPTQ's g_idx (without act-order, k // group_size) and compressed-tensors'
weight_shape are metadata the method drops as they load (`ignored_expert_suffixes`).

After loading, w13 and w2 each become the WNA16 layout of the dense layers
(kernels/wna16_layout.py: uint8 codes in blocks of 32 inputs, compact scales, uint8
zero points), stacked over the experts: `w13_wna16_qweight` [E_local, 2I, H * bits / 8]
and the rest, registered buffers (so `state_dict()`, sleep mode and memory accounting
see them); the checkpoint's tensors are deleted. The codes stay int4/int8 in memory.

Compute, on the CPU: a decode step (up to `MAX_KERNEL_TOKENS` tokens) in one C call
(kernels/wna16_moe.c: the pairs sorted by expert, each active expert's tokens through
the WNA16 GEMV on its layout, gate/up and the activation in float32), which reads the
routing from tensors, so the step records and replays as a CPU graph. Otherwise (a
prefill, CUDA, a layout with an input permutation) the experts' tokens are grouped as
for full-precision experts (`grouped_moe.grouped_experts`: one product pair per active
expert, a host read of the counts, eager), each product `wna16_linear` on the expert's
layout (the GEMV for a few tokens, dequantised tiles and a GEMM for more; the Triton
kernel on CUDA). No CUDA graph captures these layers (`supports_cuda_graphs`). Called by
`FusedMoE.forward` on every rank with this rank's experts.

Refused: act-order experts (GPTQ desc_act, compressed-tensors actorder "group"; vLLM's
WNA16 MoE kernel refuses them too) at resolution, by the configs'
`moe_unsupported_reason`; at build (`create_weights`, ValueError naming the group
setting, moe_intermediate_size and tensor_parallel_size) groups or packs that do not
divide an expert or a rank's slice of one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
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
from models.layers.quantization.kernels import wna16_cpu
from models.layers.quantization.kernels.wna16_apply import wna16_linear
from models.layers.quantization.kernels.wna16_cpu import SCALE_DTYPES
from models.layers.quantization.kernels.wna16_layout import WNA16Layout, WNA16Tensors, build_wna16_tensors
from models.layers.quantization.wna16 import AWQ_PACK_ORDER, input_groups, unpack_int32

_LAYOUT = ("qweight", "scales", "zeros", "block_group", "input_perm")  # WNA16Tensors' tensors, as buffers
_X_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # wna16_moe.c's x_dtype


_STACK = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
          ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
#: kernels/wna16_moe.c's weight arguments: the bits, each stack's codes, scales, zero points and
#: block groups (with strides), H, I
_WEIGHT_ARGTYPES = (ctypes.c_int, *_STACK, *_STACK, ctypes.c_int64, ctypes.c_int64)


def _transpose(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.t()


@dataclass(frozen=True)
class WNA16ExpertFormat:
    """How a format names and lays out one expert projection's tensors."""

    codes: str  # the packed codes' suffix
    scales: str
    zeros: str | None  # None: symmetric, no zero point stored (2^(bits-1) on the unsigned codes)
    transposed: bool  # stored [inputs, outputs] (GPTQ, AWQ)
    codes_along_outputs: bool = False  # codes packed along the outputs (AWQ), not the inputs
    order: tuple[int, ...] | None = None  # AWQ's nibble interleave (codes and zeros)
    zero_offset: int = 0  # added to the stored zero point (GPTQ v1 stores zero - 1)
    ignored: tuple[str, ...] = ()  # per-expert metadata not read

    @classmethod
    def gptq(cls, zero_offset: int) -> WNA16ExpertFormat:
        return cls("qweight", "scales", "qzeros", True, zero_offset=zero_offset, ignored=("g_idx",))

    @classmethod
    def awq(cls) -> WNA16ExpertFormat:
        return cls("qweight", "scales", "qzeros", True, codes_along_outputs=True, order=AWQ_PACK_ORDER)

    @classmethod
    def compressed_tensors(cls, symmetric: bool) -> WNA16ExpertFormat:
        return cls("weight_packed", "weight_scale", None if symmetric else "weight_zero_point", False,
                   ignored=("weight_shape",))


class WNA16MoEMethod(FusedMoEMethodBase):
    """int4/int8 experts in `fmt`'s tensors, `bits` wide, groups of `group_size` inputs
    (-1: one per output row); `group_field` names the checkpoint's group setting in
    errors. See the module docstring."""

    supports_cuda_graphs = False  # the grouping reads the per-expert counts on the host

    def __init__(self, fmt: WNA16ExpertFormat, bits: int, group_size: int, group_field: str) -> None:
        if bits not in (4, 8) or (fmt.codes_along_outputs and bits != 4):
            raise ValueError(f"{bits}-bit experts in {fmt.codes} are not supported")
        self.fmt, self.bits, self.group_size, self.group_field = fmt, bits, group_size, group_field
        self.ignored_expert_suffixes = fmt.ignored

    def _check_sizes(self, layer: nn.Module, hidden: int, inter: int) -> None:
        """Raise ValueError where the groups or packs do not divide the experts or this
        rank's slice of them."""
        full = getattr(layer, "intermediate_size", inter)
        tp = getattr(layer, "tp_size", 1) if getattr(layer, "slice_intermediate", False) else 1
        pack, group = 32 // self.bits, self.group_size
        slice_note = f" ({full} / tensor_parallel_size={tp})" if tp > 1 else ""
        if hidden % pack or inter % pack:
            raise ValueError(f"{self.bits}-bit experts with hidden_size={hidden} and {inter} intermediate features "
                             f"per rank{slice_note}: both must be multiples of {pack} (values per int32)")
        if group == -1:
            return
        setting = f"{self.group_field}={group}"
        if hidden % group or full % group:
            raise ValueError(f"{setting} does not divide the experts' inputs: hidden_size={hidden}, "
                             f"moe_intermediate_size={full}")
        if inter % group:
            raise ValueError(f"{setting} does not divide the experts' slices at tensor_parallel_size={tp}: "
                             f"moe_intermediate_size={full} leaves {inter} per rank, not whole groups; use a "
                             "tensor_parallel_size that does, or expert parallelism (whole experts per rank)")

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_per_rank: int, params_dtype: torch.dtype) -> None:
        self._check_sizes(layer, hidden_size, intermediate_per_rank)
        fmt, pack, experts = self.fmt, 32 // self.bits, num_local_experts
        transform = _transpose if fmt.transposed else None
        full = getattr(layer, "intermediate_size", intermediate_per_rank)
        for prefix, rows, cols, cols_full in (("w13", 2 * intermediate_per_rank, hidden_size, hidden_size),
                                              ("w2", hidden_size, intermediate_per_rank, full)):
            group = cols_full if self.group_size == -1 else self.group_size
            groups = -(-cols // group)
            if fmt.codes_along_outputs:
                codes_shape, codes_block = (experts, rows // pack, cols), (pack, 1)
            else:
                codes_shape, codes_block = (experts, rows, cols // pack), (1, pack)
            expert_parameter(layer, f"{prefix}_{fmt.codes}", codes_shape, torch.int32, fmt.codes, codes_block,
                             transform)
            expert_parameter(layer, f"{prefix}_{fmt.scales}", (experts, rows, groups), torch.float32, fmt.scales,
                             (1, group), transform)
            if fmt.zeros is not None:
                expert_parameter(layer, f"{prefix}_{fmt.zeros}", (experts, rows // pack, groups), torch.int32,
                                 fmt.zeros, (pack, group), transform)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        fmt = self.fmt
        if not hasattr(layer, f"w13_{fmt.codes}"):  # already in the WNA16 layout
            return
        for prefix in ("w13", "w2"):
            built = self._repack(getattr(layer, f"{prefix}_{fmt.codes}").data,
                                 getattr(layer, f"{prefix}_{fmt.scales}").data,
                                 getattr(layer, f"{prefix}_{fmt.zeros}").data if fmt.zeros is not None else None)
            for suffix in (fmt.codes, fmt.scales, fmt.zeros):
                if suffix is not None:
                    delattr(layer, f"{prefix}_{suffix}")
            for name in _LAYOUT:
                layer.register_buffer(f"{prefix}_wna16_{name}", getattr(built, name))
            setattr(layer, f"{prefix}_wna16_in_features", built.in_features)

    def _repack(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> WNA16Tensors:
        """The stacked checkpoint tensors of w13 or w2 ([E, rows, ...], as loaded) in the
        WNA16 layout."""
        fmt, bits, pack = self.fmt, self.bits, 32 // self.bits
        if zeros is None:
            zero_points = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32, device=scales.device)
        else:
            zero_points = unpack_int32(zeros, bits, dim=1, order=fmt.order) + fmt.zero_offset
        k = codes.shape[2] if fmt.codes_along_outputs else codes.shape[2] * pack
        groups = input_groups(k, self.group_size, None, scales.shape[2])

        def codes_rows(expert: int, start: int, stop: int) -> torch.Tensor:
            if fmt.codes_along_outputs:
                return unpack_int32(codes[expert, start // pack : stop // pack], bits, dim=0, order=fmt.order)
            return unpack_int32(codes[expert, start:stop], bits, dim=1)

        return build_wna16_tensors(bits, codes_rows, scales, zero_points, groups)

    def layouts(self, layer: nn.Module) -> tuple[list[WNA16Layout], list[WNA16Layout]]:
        """(w13's, w2's) layout of every local expert: views of the stacked buffers, kept
        beside them and rebuilt when a buffer is no longer the tensor they view (a
        reload). RuntimeError before `process_weights_after_loading`."""
        buffers = layer._buffers
        current = tuple(buffers.get(f"{prefix}_wna16_{name}") for prefix in ("w13", "w2") for name in _LAYOUT)
        cached = layer.__dict__.get("_wna16_expert_layouts")
        if cached is not None and all(a is b for a, b in zip(cached[0], current)):
            return cached[1]
        if current[0] is None:
            raise RuntimeError(f"{type(layer).__name__}: quantised experts used before process_weights_after_loading")
        result = []
        for prefix, tensors in (("w13", current[:5]), ("w2", current[5:])):
            stacked = WNA16Tensors(self.bits, getattr(layer, f"{prefix}_wna16_in_features"), *tensors)
            result.append([stacked.layout(e) for e in range(stacked.qweight.shape[0])])
        layouts = (result[0], result[1])
        layer.__dict__["_wna16_expert_layouts"] = (current, layouts)
        return layouts

    def _weight_args(self, layer: nn.Module) -> list[Any]:
        """kernels/wna16_moe.c's weight arguments: the bits, each stack's codes, scales, zero
        points and block groups with their strides, then H and I."""
        args: list[Any] = [self.bits]
        for prefix in ("w13", "w2"):
            q, s, z, bg = (getattr(layer, f"{prefix}_wna16_{name}") for name in ("qweight", "scales", "zeros",
                                                                                   "block_group"))
            args += [q.data_ptr(), q[0].numel(), s.data_ptr(), s[0].numel() * s.element_size(), SCALE_DTYPES[s.dtype],
                     z.data_ptr(), z[0].numel(), bg.data_ptr(), s.shape[2]]
        return [*args, layer.w2_wna16_qweight.shape[1], layer.w2_wna16_in_features]

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if (one_call_applies(x, _X_DTYPES, MAX_KERNEL_TOKENS) and layer.w13_wna16_input_perm is None
                and layer.w2_wna16_input_perm is None and (kernel := wna16_cpu.load()) is not None):
            entry = bind_one_call(kernel.lib, "wna16_moe", _WEIGHT_ARGTYPES)
            y = one_call_experts(entry, self._weight_args(layer), x, _X_DTYPES[x.dtype], topk_weights, topk_ids,
                                 layer.expert_map, layer.num_experts, layer.w13_wna16_qweight.shape[0],
                                 "int4/int8 experts")
            if y is not None:
                return y.to(x.dtype)
        w13, w2 = self.layouts(layer)
        return grouped_experts(x, topk_weights, topk_ids, layer.expert_map, len(w13), w2[0].in_features,
                               lambda e, rows: wna16_linear(rows, w13[e]), lambda e, act: wna16_linear(act, w2[e]))
