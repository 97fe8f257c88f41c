"""compressed-tensors FP8: float8_e4m3fn weights, fp8 (or 16-bit) activations.

llm-compressor's FP8 recipes (`float-quantized` / `naive-quantized` format) store each
linear layer's `weight` [out, in] float8_e4m3fn and `weight_scale`: [out, 1] for the
"channel" strategy (FP8_DYNAMIC), one value for "tensor" (FP8), [ceil(out/bn),
ceil(in/bk)] for "block" (FP8_BLOCK, `block_structure` [128, 128]). Activations are
quantised per token or per tensor, dynamically (or not at all: W8A16). The tensors
and the compute are native fp8 checkpoints' (fp8_checkpoint.Fp8CheckpointLinearMethod,
which this scheme drives): on the CPU, weight tiles dequantised into the activations'
dtype, activations left unquantised; see that module for CUDA and for tensor
parallelism with blocks.

Refused (ValueError naming `config_groups.<group>.<field>` and the value): weights other
than symmetric 8-bit float with a static channel/tensor/block strategy, static
(calibrated) input scales, asymmetric or non-fp8 activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers.quantization.compressed_tensors.schemes.base import (
    CompressedTensorsScheme,
)
from models.layers.quantization.fp8_checkpoint import Fp8CheckpointLinearMethod


def parse_block_structure(group: str, value: Any) -> tuple[int, int]:
    """[rows, cols] (or llm-compressor's older "RxC" string) as a pair of positive ints."""
    if isinstance(value, str) and "x" in value:
        value = value.split("x")
    try:
        rows, cols = (int(v) for v in value)
    except (TypeError, ValueError):
        rows = cols = 0
    if rows <= 0 or cols <= 0:
        raise ValueError(f"config_groups.{group}.weights.block_structure={value!r} must be two positive integers")
    return rows, cols


class CompressedTensorsW8A8Fp8(CompressedTensorsScheme):
    """One config group of fp8 weights (see the module docstring)."""

    def __init__(self, group: str, weights: dict[str, Any], input_activations: dict[str, Any] | None,
                 fmt: str | None) -> None:
        super().__init__(group, weights, input_activations, fmt)
        where = f"config_groups.{group}"
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"{where}.weights.strategy={strategy!r} is not supported for fp8 weights; "
                             "supported: 'channel', 'tensor', 'block'")
        if weights.get("symmetric", True) is not True:
            raise ValueError(f"{where}.weights.symmetric={weights.get('symmetric')!r}: fp8 weights must be "
                             "symmetric")
        if weights.get("dynamic", False):
            raise ValueError(f"{where}.weights.dynamic={weights.get('dynamic')!r}: weights must carry their scales")
        block = parse_block_structure(group, weights.get("block_structure")) if strategy == "block" else None
        dynamic = False
        if input_activations is not None:
            acts = input_activations
            if acts.get("type", "float") != "float" or acts.get("num_bits") != 8:
                raise ValueError(f"{where}.input_activations (type={acts.get('type')!r}, "
                                 f"num_bits={acts.get('num_bits')!r}) is not supported with fp8 weights; "
                                 "supported: 8-bit float, or none")
            if acts.get("dynamic") is not True:
                raise ValueError(f"{where}.input_activations.dynamic={acts.get('dynamic')!r} is not supported: "
                                 "static input scales are not served; supported: true")
            if acts.get("symmetric", True) is not True:
                raise ValueError(f"{where}.input_activations.symmetric={acts.get('symmetric')!r} is not supported")
            dynamic = True
        self.method = Fp8CheckpointLinearMethod(strategy, block, "weight_scale", dynamic,
                                                f"{where}.weights.block_structure")

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        self.method.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                   output_size, params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.method.process_weights_after_loading(layer)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.method.apply(layer, x, bias)
