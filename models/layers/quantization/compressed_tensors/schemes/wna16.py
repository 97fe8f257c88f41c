"""compressed-tensors W4A16 / W8A16 (`pack-quantized`): int4/int8 weights, 16-bit activations.

The checkpoint's layout (compressed-tensors' PackedQuantizationCompressor), per linear
module (K inputs, N outputs, pack = 32 / num_bits, G groups of `group_size` inputs, or
one per row for the "channel" strategy):

    weight_packed      int32 [N, K / pack]  the codes q + 2^(bits-1) (signed to unsigned),
                                            packed along the inputs, value j in bits j*bits
    weight_scale       [N, G]               w = (q - zero) * scale
    weight_zero_point  int32 [N / pack, G]  asymmetric only: zero + 2^(bits-1), packed
                                            along the OUTPUTS (dim 0)
    weight_shape       [2]                  the unpacked [N, K]
    weight_g_idx       int32 [K]            actorder "group" only: each input's group

Symmetric weights have no zero point (it is 0, so 2^(bits-1) on the unsigned codes).
Tensor parallelism: a column-parallel shard is whole output rows; a row-parallel shard
narrows weight_packed, weight_scale and weight_zero_point along the inputs (the shard
holds whole groups: `group_size` must divide K / tensor_parallel_size), except with
actorder "group", where the scales and zero points stay whole on every rank and the
sliced weight_g_idx picks them (as GPTQ's desc_act). After loading, the tensors become
the WNA16 layout (models/layers/quantization/kernels/wna16_layout.py).

Refused at resolution (ValueError naming `config_groups.<group>.<field>` and the value):
a format other than pack-quantized, num_bits other than 4 and 8, a strategy other than
group/channel, group sizes that are not a multiple of 32, dynamic weights, an unknown
actorder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers.quantization.compressed_tensors.schemes.base import (
    CompressedTensorsScheme,
)
from models.layers.quantization.kernels.wna16_apply import apply_wna16
from models.layers.quantization.kernels.wna16_layout import set_wna16_layout
from models.layers.quantization.wna16 import (
    check_bits_and_group,
    fused_replica_loader,
    input_groups,
    int_parameter,
    plan_groups,
    unpack_int32,
)

_CHECKPOINT_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# actorder values (compressed-tensors' ActivationOrdering; True means "group") -> whether g_idx is stored
_ACTORDER = {None: False, False: False, "weight": False, "static": False, "group": True, True: True}


class CompressedTensorsWNA16(CompressedTensorsScheme):
    """int4/int8 weight-only layers of one config group."""

    def __init__(self, group: str, weights: dict[str, Any], input_activations: dict[str, Any] | None,
                 fmt: str | None) -> None:
        super().__init__(group, weights, input_activations, fmt)
        where = f"config_groups.{group}"
        if fmt != "pack-quantized":
            raise ValueError(f"{where}.format={fmt!r} is not supported for int{weights.get('num_bits')} weights "
                             "without activation quantisation; supported: 'pack-quantized'")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{where}.weights.strategy={strategy!r} is not supported; supported: 'group', "
                             "'channel'")
        self.bits = weights.get("num_bits")
        self.group_size = weights.get("group_size") if strategy == "group" else -1
        check_bits_and_group(self.bits, self.group_size, f"{where}.weights.num_bits", f"{where}.weights.group_size")
        if weights.get("dynamic", False) is not False:
            raise ValueError(f"{where}.weights.dynamic={weights.get('dynamic')!r} is not supported")
        self.symmetric = weights.get("symmetric", True)
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"{where}.weights.symmetric={self.symmetric!r} must be true or false")
        actorder = weights.get("actorder")
        if actorder not in _ACTORDER or (actorder is not None and not isinstance(actorder, (bool, str))):
            raise ValueError(f"{where}.weights.actorder={actorder!r} is not supported; supported: null, 'group', "
                             "'weight', 'static'")
        self.has_g_idx = _ACTORDER[actorder] and strategy == "group"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        pack = 32 // self.bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        groups, whole = plan_groups(layer, self.bits, self.group_size, self.has_g_idx, k, output_partition_sizes,
                                    input_size, f"quantization_config.config_groups.{self.group}.weights.group_size")
        group_dim = {} if whole else {"input_dim": 1}
        fused = len(output_partition_sizes) > 1
        int_parameter(layer, "weight_packed", (n, k // pack), torch.int32, weight_loader, output_dim=0,
                      input_dim=1, packed_dim=1, packed_factor=pack)
        int_parameter(layer, "weight_scale", (n, groups), torch.float32, weight_loader, output_dim=0, **group_dim)
        if not self.symmetric:
            int_parameter(layer, "weight_zero_point", (n // pack, groups), torch.int32, weight_loader, output_dim=0,
                          packed_dim=0, packed_factor=pack, **group_dim)
        int_parameter(layer, "weight_shape", (2,), torch.int64, fused_replica_loader(weight_loader, fused))
        if self.has_g_idx:
            int_parameter(layer, "weight_g_idx", (k,), torch.int32, fused_replica_loader(weight_loader, fused),
                          input_dim=0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "weight_packed"):  # already in the WNA16 layout
            return
        packed = layer.weight_packed.data
        n, k = packed.shape[0], packed.shape[1] * (32 // self.bits)
        scales = layer.weight_scale.data
        if self.symmetric:
            zeros = torch.full(scales.shape, 1 << (self.bits - 1), dtype=torch.int32)
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, self.bits, dim=0)
        groups = input_groups(k, self.group_size, layer.weight_g_idx.data if self.has_g_idx else None,
                              scales.shape[1])
        assert zeros.shape == (n, scales.shape[1]), (zeros.shape, scales.shape)

        def codes_rows(start: int, stop: int) -> torch.Tensor:
            return unpack_int32(packed[start:stop], self.bits, dim=1)

        set_wna16_layout(layer, self.bits, codes_rows, scales, zeros, groups, _CHECKPOINT_PARAMS)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return apply_wna16(layer, x, bias)
