"""GPTQ checkpoints (AutoGPTQ / GPTQModel): `quant_method: "gptq"`, int4 or int8 weights.

The checkpoint's layout, per linear module (K inputs, N outputs, pack = 32 / bits):

    qweight  int32 [K / pack, N]   codes packed along the inputs, value j of a pack in bits j*bits
    qzeros   int32 [G, N / pack]   zero points packed along the outputs; checkpoint_format
                                   "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself
    scales   float16 [G, N]        w[k, n] = (q[k, n] - zero[g, n]) * scales[g, n], g = g_idx[k]
    g_idx    int32 [K]             the group of each input: k // group_size, or with
                                   desc_act (act-order) the group its quantisation order gave it

G = K / group_size (group_size -1: G = 1). Symmetric checkpoints store the zero point
too (2^(bits-1)), so `sym` needs nothing of its own.

Tensor parallelism: a column-parallel shard is whole output columns (qweight, qzeros
and scales narrow along N, in packed units for qzeros); a row-parallel shard narrows
qweight, g_idx and, without desc_act, scales and qzeros along the inputs (its inputs
then hold whole groups: `group_size` must divide K / tensor_parallel_size). With
desc_act a shard's inputs fall in any group, so, as vLLM does, scales and qzeros stay
whole on every rank and g_idx (sliced) picks the groups.

After loading, everything becomes the WNA16 layout (kernels/wna16_layout.py): act-order
inputs are sorted by group once (and the activations gathered to match per call).
Refused (ValueError naming `quantization_config.<field>` and the value, a ConfigError
at resolution): bits other than 4 and 8, group sizes that are not -1 or a multiple of
32, `checkpoint_format` other than gptq/gptq_v2 (marlin, ...), `is_marlin_format`, a
quantised `lm_head`, per-module `dynamic` overrides. A mixture-of-experts checkpoint's
experts are int4/int8 too (wna16_moe.py), without desc_act (refused at resolution).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers.quantization.base import LinearMethodBase
from models.layers.quantization.kernels.wna16_layout import set_wna16_layout
from models.layers.quantization.wna16 import (
    WNA16Config,
    WNA16LinearMethod,
    check_bits_and_group,
    fused_replica_loader,
    input_groups,
    int_parameter,
    plan_groups,
    unpack_int32,
)
from models.layers.quantization.wna16_moe import WNA16ExpertFormat, WNA16MoEMethod

CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what to add to the stored zero point
_CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales", "g_idx")


class GPTQLinearMethod(WNA16LinearMethod, LinearMethodBase):
    """One GPTQ layer: the checkpoint's tensors, then the WNA16 layout (`config`: its GPTQConfig)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        cfg = self.config
        pack = 32 // cfg.bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        groups, whole = plan_groups(layer, cfg.bits, cfg.group_size, cfg.desc_act, k, output_partition_sizes,
                                    input_size, "quantization_config.group_size")
        group_dim = {} if whole else {"input_dim": 0}
        int_parameter(layer, "qweight", (k // pack, n), torch.int32, weight_loader, input_dim=0, output_dim=1,
                      packed_dim=0, packed_factor=pack)
        int_parameter(layer, "qzeros", (groups, n // pack), torch.int32, weight_loader, output_dim=1, packed_dim=1,
                      packed_factor=pack, **group_dim)
        int_parameter(layer, "scales", (groups, n), torch.float32, weight_loader, output_dim=1, **group_dim)
        int_parameter(layer, "g_idx", (k,), torch.int32,
                      fused_replica_loader(weight_loader, len(output_partition_sizes) > 1), input_dim=0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "qweight"):  # already in the WNA16 layout
            return
        cfg = self.config
        qweight = layer.qweight.data
        zeros = unpack_int32(layer.qzeros.data, cfg.bits, dim=1).t() + CHECKPOINT_FORMATS[cfg.checkpoint_format]
        # Without desc_act the groups are contiguous (the checkpoint's g_idx is k // group_size,
        # a global index on a row-parallel shard, which holds its own groups): not needed.
        groups = input_groups(layer.g_idx.numel(), cfg.group_size, layer.g_idx.data if cfg.desc_act else None,
                              zeros.shape[1])

        def codes_rows(start: int, stop: int) -> torch.Tensor:
            return unpack_int32(qweight[:, start:stop], cfg.bits, dim=0).t()

        set_wna16_layout(layer, cfg.bits, codes_rows, layer.scales.data.t(), zeros, groups,
                         _CHECKPOINT_PARAMS)


class GPTQConfig(WNA16Config):
    """The checkpoint's GPTQ settings; every linear layer not in `modules_to_not_convert`
    gets `GPTQLinearMethod`."""

    name = "gptq"
    linear_method_cls = GPTQLinearMethod

    def __init__(self, bits: int, group_size: int, desc_act: bool, checkpoint_format: str,
                 modules_to_not_convert: list[str]) -> None:
        self.bits, self.group_size, self.desc_act = bits, group_size, desc_act
        self.checkpoint_format = checkpoint_format
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> GPTQConfig:
        if not hf_quant_config:
            raise ValueError("quantization='gptq' needs the checkpoint's quantization_config (or quantize_config.json)")
        q = hf_quant_config
        bits, group_size = q.get("bits"), q.get("group_size", 128)
        check_bits_and_group(bits, group_size, "quantization_config.bits", "quantization_config.group_size")
        if q.get("is_marlin_format"):
            raise ValueError("quantization_config.is_marlin_format=True is not supported: Marlin-repacked GPTQ "
                             "weights are a GPU kernel's layout; use the plain GPTQ checkpoint")
        fmt = q.get("checkpoint_format") or "gptq"
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not supported; supported: "
                             f"{list(CHECKPOINT_FORMATS)}")
        for field in ("desc_act", "sym"):
            if not isinstance(q.get(field, False), bool):
                raise ValueError(f"quantization_config.{field}={q.get(field)!r} must be true or false")
        if q.get("lm_head"):
            raise ValueError("quantization_config.lm_head=True is not supported: the LM head stays unquantised")
        if q.get("dynamic"):
            raise ValueError(f"quantization_config.dynamic={q.get('dynamic')!r} (per-module overrides) is not "
                             "supported")
        skip = cls.parse_modules_to_not_convert(q)
        return cls(bits, group_size, bool(q.get("desc_act", False)), fmt, skip)

    def moe_unsupported_reason(self, expert_names: list[list[str]] | None = None) -> str | None:
        if self.desc_act:
            return ("quantization_config.desc_act=True: act-order (g_idx) experts are not supported; int4/int8 "
                    "experts are served without desc_act")
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> Any:
        """int4/int8 experts in GPTQ's tensors (wna16_moe.WNA16MoEMethod); None with
        desc_act (refused at resolution: `moe_unsupported_reason`)."""
        if self.desc_act:
            return None
        return WNA16MoEMethod(WNA16ExpertFormat.gptq(CHECKPOINT_FORMATS[self.checkpoint_format]), self.bits,
                              self.group_size, "quantization_config.group_size")

    def __repr__(self) -> str:
        return (f"GPTQConfig(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
                f"checkpoint_format={self.checkpoint_format!r})")
