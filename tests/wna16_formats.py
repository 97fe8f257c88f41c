"""Reference quantisers for the int4/int8 weight-only formats, written from their documented
layouts (for tests/quant_checkpoints.py's `write_quantized_checkpoint`):

- GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K / pack, N] packed along the inputs,
  qzeros int32 [G, N / pack] packed along the outputs (v1 "gptq" stores zero - 1,
  "gptq_v2" the zero), scales float16 [G, N], g_idx int32 [K]; with desc_act the inputs
  are quantised in a permuted order and g_idx[k] is the group of k's position in it.
- AWQ GEMM (AutoAWQ): qweight int32 [K, N / 8] and qzeros int32 [G, N / 8] packed along
  the outputs in the interleaved order (0, 2, 4, 6, 1, 3, 5, 7), scales float16 [G, N].
- compressed-tensors pack-quantized: weight_packed int32 [N, K / pack] (signed codes +
  2^(bits-1), packed along the inputs), weight_scale [N, G] (bfloat16 here),
  weight_zero_point int32 [N / pack, G] packed along the outputs (asymmetric only),
  weight_shape [2], weight_g_idx [K] (actorder "group").

Each returns `quantize(module_name, weight) -> (tensors, dequantised weight)`; the
dequantised weight is what the format's documented formula gives for those tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from tests.quant_checkpoints import pack_int32, quantize_int_groups

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
Quantize = Callable[[str, torch.Tensor], "tuple[dict[str, torch.Tensor], torch.Tensor]"]


_SAME_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def _act_order(name: str, k: int) -> torch.Tensor:
    """A permutation of the inputs (GPTQ's activation order), fixed per module name; the
    modules that read the same activations (q/k/v, gate/up) share it, as GPTQ's order
    comes from the inputs' statistics."""
    parent, _, leaf = name.rpartition(".")
    key = f"{parent}.{_SAME_INPUTS.get(leaf, leaf)}"
    return torch.randperm(k, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def _grouped(weight: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: torch.Tensor | None,
             scale_dtype: torch.dtype, min_zero: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K], scales [N, G] (as stored, in scale_dtype), zeros [N, G], g_idx [K],
    dequantised [N, K]) for groups in `act_order` (None: natural order)."""
    k = weight.shape[1]
    group = k if group_size == -1 else group_size
    order = torch.arange(k) if act_order is None else act_order
    position = torch.argsort(order)  # position[k] = where input k sits in the order
    _, scales, zeros = quantize_int_groups(weight[:, order], bits, group, sym)
    scales = scales.to(scale_dtype)  # the codes are chosen against the scales as stored
    zeros = zeros.clamp(min=min_zero)
    g_idx = (position // group).to(torch.int32)
    s = scales.float()[:, g_idx.long()]
    z = zeros[:, g_idx.long()]
    codes = torch.round(weight / s + z).clamp(0, (1 << bits) - 1).to(torch.int32)
    return codes, scales, zeros, g_idx, (codes - z).float() * s


def gptq_quantizer(bits: int, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str = "gptq"
                   ) -> Quantize:
    offset = 1 if checkpoint_format == "gptq" else 0

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        order = _act_order(name, weight.shape[1]) if desc_act else None
        # v1 stores zero - 1, so a zero of 0 cannot be written: GPTQ v1's own limitation.
        codes, scales, zeros, g_idx, deq = _grouped(weight, bits, group_size, sym, order, torch.float16,
                                                    min_zero=offset)
        tensors = {
            "qweight": pack_int32(codes.t(), bits, dim=0),
            "qzeros": pack_int32((zeros - offset).t(), bits, dim=1),
            "scales": scales.t().contiguous(),
            "g_idx": g_idx,
        }
        return tensors, deq

    return quantize


def awq_quantizer(group_size: int) -> Quantize:
    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes, scales, zeros, _, deq = _grouped(weight, 4, group_size, False, None, torch.float16)
        tensors = {
            "qweight": pack_int32(codes.t(), 4, dim=1, order=AWQ_ORDER),
            "qzeros": pack_int32(zeros.t(), 4, dim=1, order=AWQ_ORDER),
            "scales": scales.t().contiguous(),
        }
        return tensors, deq

    return quantize


def ct_quantizer(bits: int, group_size: int, sym: bool, actorder_group: bool = False,
                 scale_dtype: torch.dtype = torch.bfloat16) -> Quantize:
    """group_size -1: the "channel" strategy (weight_scale [N, 1])."""

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        order = _act_order(name, weight.shape[1]) if actorder_group else None
        codes, scales, zeros, g_idx, deq = _grouped(weight, bits, group_size, sym, order, scale_dtype)
        # codes are already signed + 2^(bits-1): the zero point of symmetric weights is that offset.
        tensors = {
            "weight_packed": pack_int32(codes, bits, dim=1),
            "weight_scale": scales.contiguous(),
            "weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
        }
        if not sym:
            tensors["weight_zero_point"] = pack_int32(zeros, bits, dim=0)
        if actorder_group:
            tensors["weight_g_idx"] = g_idx
        return tensors, deq

    return quantize


def ct_quantization_config(bits: int, group_size: int, sym: bool, actorder: str | None = None,
                           ignore: list[str] | None = None) -> dict:
    """config.json's quantization_config for one W{bits}A16 group over every Linear but the LM head."""
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "actorder": actorder, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"] + (ignore or []), "kv_cache_scheme": None, "sparsity_config": {}}
