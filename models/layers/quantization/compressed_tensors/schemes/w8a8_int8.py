"""compressed-tensors W8A8 int8: int8 weights per channel, int8 activations per token.

llm-compressor's W8A8 recipe (SmoothQuant/GPTQ + `int-quantized` format) stores each
linear layer's `weight` [out, in] int8 (symmetric: no zero point) and `weight_scale`
[out, 1]; activations are quantised per token, dynamically, at run time:

    y = (xq @ weight^T) * x_scale[token] * weight_scale[out] (+ bias)

with exact int32 sums (models/layers/quantization/int8_gemm.py: torch._int_mm, oneDNN's
VNNI int8 GEMM on this CPU). The weight stays as the checkpoint stores it (at TP 1, a
view of the file's pages), so a layer holds 1 byte per weight plus its float32 scale
per output row. Tensor parallelism needs nothing special: a column shard holds whole
rows with their scales; a row shard holds an input slice, which each rank quantises
with its own per-token scales, and whose partial sums, each scaled by the full row's
weight scale, add up over the ranks.

Refused (ValueError naming `config_groups.<group>.<field>` and the value): weights not
8-bit symmetric per channel (or "tensor"), and activations that are static (a
calibrated `input_scale`), asymmetric (a zero point) or not per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers.quantization.compressed_tensors.schemes.base import (
    CompressedTensorsScheme,
)
from models.layers.quantization.int8_gemm import int8_linear, quantize_per_token
from models.layers.quantization.per_tensor_scales import (
    per_channel_from_shards,
    scalar_per_shard_loader,
)


def _require(where: str, args: dict[str, Any], field: str, allowed: tuple[Any, ...], default: Any) -> Any:
    value = args.get(field, default)
    if value not in allowed:
        raise ValueError(f"{where}.{field}={value!r} is not supported for W8A8 int8; supported: {list(allowed)}")
    return value


class CompressedTensorsW8A8Int8(CompressedTensorsScheme):
    """One config group of int8 weights with dynamic per-token int8 activations."""

    def __init__(self, group: str, weights: dict[str, Any], input_activations: dict[str, Any] | None,
                 fmt: str | None) -> None:
        super().__init__(group, weights, input_activations, fmt)
        where = f"config_groups.{group}"
        self.strategy = _require(f"{where}.weights", weights, "strategy", ("channel", "tensor"), "tensor")
        _require(f"{where}.weights", weights, "symmetric", (True,), True)
        _require(f"{where}.weights", weights, "dynamic", (False,), False)
        acts = input_activations or {}
        _require(f"{where}.input_activations", acts, "dynamic", (True,), False)
        _require(f"{where}.input_activations", acts, "symmetric", (True,), True)
        _require(f"{where}.input_activations", acts, "strategy", ("token",), "tensor")

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        out_features = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(out_features, input_size_per_partition, dtype=torch.int8),
                              requires_grad=False)
        weight.weight_loader, weight.output_dim, weight.input_dim = weight_loader, 0, 1
        layer.register_parameter("weight", weight)
        if self.strategy == "channel":
            scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
            scale.weight_loader, scale.output_dim = weight_loader, 0
        else:  # one value per checkpoint module: per channel after loading
            scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False)
            scale.weight_loader = scalar_per_shard_loader
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Makes a per-tensor scale per channel; the int8 weight itself is left as loaded
        (no copy). A second call changes nothing."""
        if self.strategy == "tensor" and layer.weight_scale.dim() == 1:
            layer.weight_scale = nn.Parameter(per_channel_from_shards(layer.weight_scale.data,
                                                                      layer.output_partition_sizes),
                                              requires_grad=False)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xq, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
        scale = layer.weight_scale
        if scale.dim() == 1:  # per-tensor, before loading finished: one value per fused shard
            scale = per_channel_from_shards(scale, layer.output_partition_sizes)
        y = int8_linear(xq, x_scale, layer.weight, scale, bias, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])
