"""AWQ checkpoints (AutoAWQ's GEMM version): `quant_method: "awq"`, int4 weights with zero points.

The checkpoint's layout, per linear module (K inputs, N outputs, groups of `group_size`
inputs, G = K / group_size):

    qweight  int32 [K, N / 8]   codes packed along the outputs in AWQ's interleaved order:
                                nibble j of an int32 holds output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]
    qzeros   int32 [G, N / 8]   the zero points, packed the same way
    scales   float16 [G, N]     w[k, n] = (q[k, n] - zero[k // group_size, n]) * scales[.., n]

Tensor parallelism: a column-parallel shard is whole output columns (in packed units
for qweight and qzeros); a row-parallel shard narrows every tensor along the inputs,
so `group_size` must divide K / tensor_parallel_size. After loading, the tensors become
the WNA16 layout (kernels/wna16_layout.py) the CPU and Triton kernels read.

The config comes from config.json's `quantization_config` or AutoAWQ's quant_config.json
(`w_bit`, `q_group_size`, `zero_point`, `version`). Refused (ValueError naming
`quantization_config.<field>` and the value): bits other than 4, group sizes that are
not -1 or a multiple of 32, `zero_point` false (the zero points would be missing), a
`version` other than "gemm" (GEMV, Marlin and exllama layouts). A mixture-of-experts
checkpoint's experts are int4 too (wna16_moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers.quantization.base import LinearMethodBase
from models.layers.quantization.kernels.wna16_layout import set_wna16_layout
from models.layers.quantization.wna16 import (
    AWQ_PACK_ORDER,
    WNA16Config,
    WNA16LinearMethod,
    check_bits_and_group,
    input_groups,
    int_parameter,
    plan_groups,
    unpack_int32,
)
from models.layers.quantization.wna16_moe import WNA16ExpertFormat, WNA16MoEMethod

PACK = 8  # int4 values per int32
_CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales")


class AWQLinearMethod(WNA16LinearMethod, LinearMethodBase):
    """One AWQ layer: the checkpoint's tensors, then the WNA16 layout (`config`: its AWQConfig)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        k, n = input_size_per_partition, sum(output_partition_sizes)
        groups, whole = plan_groups(layer, 4, self.config.group_size, False, k, output_partition_sizes, input_size,
                                    "quantization_config.group_size")
        group_dim = {} if whole else {"input_dim": 0}
        int_parameter(layer, "qweight", (k, n // PACK), torch.int32, weight_loader, input_dim=0, output_dim=1,
                      packed_dim=1, packed_factor=PACK)
        int_parameter(layer, "qzeros", (groups, n // PACK), torch.int32, weight_loader, output_dim=1, packed_dim=1,
                      packed_factor=PACK, **group_dim)
        int_parameter(layer, "scales", (groups, n), torch.float32, weight_loader, output_dim=1, **group_dim)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "qweight"):  # already in the WNA16 layout
            return
        qweight = layer.qweight.data
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_PACK_ORDER).t()
        groups = input_groups(qweight.shape[0], self.config.group_size, None, zeros.shape[1])

        def codes_rows(start: int, stop: int) -> torch.Tensor:
            return unpack_int32(qweight[:, start // PACK : stop // PACK], 4, dim=1, order=AWQ_PACK_ORDER).t()

        set_wna16_layout(layer, 4, codes_rows, layer.scales.data.t(), zeros, groups, _CHECKPOINT_PARAMS)


class AWQConfig(WNA16Config):
    """The checkpoint's AWQ settings; every linear layer not in `modules_to_not_convert`
    gets `AWQLinearMethod`."""

    name = "awq"
    linear_method_cls = AWQLinearMethod

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> AWQConfig:
        if not hf_quant_config:
            raise ValueError("quantization='awq' needs the checkpoint's quantization_config (or quant_config.json)")
        q = hf_quant_config
        bits_field = "bits" if "bits" in q else "w_bit"
        group_field = "group_size" if "group_size" in q else "q_group_size"
        bits, group_size = q.get(bits_field), q.get(group_field, 128)
        check_bits_and_group(bits, group_size, f"quantization_config.{bits_field}",
                             f"quantization_config.{group_field}")
        if bits != 4:
            raise ValueError(f"quantization_config.{bits_field}={bits!r} is not supported; AWQ supports 4")
        if q.get("zero_point", True) is not True:
            raise ValueError(f"quantization_config.zero_point={q.get('zero_point')!r} is not supported: AWQ's GEMM "
                             "checkpoints carry zero points (qzeros)")
        version = q.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ValueError(f"quantization_config.version={version!r} is not supported; supported: 'gemm'")
        skip = cls.parse_modules_to_not_convert(q)
        return cls(group_size, skip)

    def moe_unsupported_reason(self, expert_names: list[list[str]] | None = None) -> str | None:
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> Any:
        """int4 experts in AWQ's tensors (wna16_moe.WNA16MoEMethod)."""
        return WNA16MoEMethod(WNA16ExpertFormat.awq(), 4, self.group_size, "quantization_config.group_size")

    def __repr__(self) -> str:
        return f"AWQConfig(group_size={self.group_size})"
