"""Serialized fp8 checkpoints: float8_e4m3fn weights with their scales, as shipped.

Two producers write them, with the same tensors under different names:

- native fp8 (`quant_method: "fp8"`; DeepSeek-V3, Qwen3-FP8): `weight` [out, in]
  float8_e4m3fn and, with `weight_block_size: [bn, bk]`, `weight_scale_inv`
  [ceil(out/bn), ceil(in/bk)] float32 (the factor that multiplies q back, despite its
  name); without blocks, a per-tensor `weight_scale` (one per checkpoint module).
  `Fp8CheckpointConfig` reads that quantization_config (`get_quantization_config`
  chooses it over the online Fp8Config when a checkpoint has one);
- compressed-tensors FP8 (`float-quantized`): `weight` and `weight_scale` [out, 1]
  (strategy "channel"), [1] ("tensor") or [out/bn, in/bk] ("block");
  schemes/w8a8_fp8.py builds this same method.

A mixture-of-experts checkpoint's experts in this layout (blocks, or per tensor) go to
`fp8_moe.Fp8MoEMethod` (`Fp8CheckpointConfig.get_moe_method`).

`Fp8CheckpointLinearMethod` registers those tensors for this rank's shard, tagged so the
layer's generic weight loaders slice them (block scales: `packed_dim`/`packed_factor`
= block rows, so a fused layer's q/k/v or gate/up offsets land on whole blocks). A
per-tensor scale gets its own loader (one value per fused sub-projection) and becomes a
per-channel [out, 1] float32 scale after loading, so one apply path serves both.

Block scales under tensor parallelism: a rank's shard must hold whole blocks, so a
column-parallel layer's (or a fused layer's) per-rank output sizes and a row-parallel
layer's per-rank input size must be multiples of the block; otherwise create_weights
raises a ValueError naming weight_block_size and tensor_parallel_size (as vLLM does).

Compute: on the CPU, `fp8_kernels.fp8_linear` (decode batches read the fp8 bytes
straight into float32 dot products; larger ones dequantise weight tiles into x's dtype
for F.linear); activations stay in x's dtype even where the checkpoint asks for
dynamic fp8 activations (more accurate than the checkpoint's own recipe). On CUDA
with compute capability >= 8.9, per-channel (and per-tensor) layers with dynamic fp8
activations use torch._scaled_mm as online fp8 does (fp8.Fp8LinearMethod); the other
layers (blocks, weight-only) go through `fp8_linear`'s Triton GEMM, which reads the
fp8 bytes (kernels/fp8_triton.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig
from models.layers.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod
from models.layers.quantization.fp8_kernels import fp8_linear
from models.layers.quantization.fp8_moe import Fp8MoEMethod
from models.layers.quantization.per_tensor_scales import (
    per_channel_from_shards,
    scalar_per_shard_loader,
)
from models.layers.quantization.wna16 import not_converted

STRATEGIES = ("channel", "tensor", "block")


def check_block_fits_shard(layer: nn.Module, block: tuple[int, int], field: str, input_size_per_partition: int,
                           output_partition_sizes: list[int], input_size: int, output_size: int) -> None:
    """Raise ValueError (naming `field`, the checkpoint's block size setting, and the
    tensor_parallel_size) unless this rank's shard of `layer` holds whole scale blocks."""
    block_n, block_k = block
    tp_size = getattr(layer, "tp_size", 1)
    input_sharded = input_size_per_partition != input_size
    output_split = sum(output_partition_sizes) != output_size or len(output_partition_sizes) > 1
    bad_out = [size for size in output_partition_sizes if size % block_n] if output_split else []
    bad_in = input_sharded and input_size_per_partition % block_k != 0
    if bad_out or bad_in:
        what = (f"output sizes per rank {output_partition_sizes}" if bad_out
                else f"input size per rank {input_size_per_partition}")
        raise ValueError(f"quantization_config.{field}={[block_n, block_k]} does not divide "
                         f"{type(layer).__name__}'s shard at tensor_parallel_size={tp_size} ({what}): every rank "
                         "must hold whole scale blocks; use a tensor_parallel_size that divides the layers into "
                         "multiples of the block")


class Fp8CheckpointLinearMethod(LinearMethodBase):
    """A serialized fp8 weight and its scales (see the module docstring).

    `strategy` is "channel", "tensor" or "block" (with `block` = (rows, cols));
    `scale_name` the checkpoint's name for the weight scale; `dynamic_activations`
    whether the checkpoint quantises activations (per token, dynamically) where a kernel
    can (CUDA _scaled_mm); False is weight-only (W8A16). `block_field` names the
    checkpoint's block-size setting in errors.
    """

    def __init__(self, strategy: str, block: tuple[int, int] | None, scale_name: str,
                 dynamic_activations: bool, block_field: str = "weight_block_size") -> None:
        if strategy not in STRATEGIES or (strategy == "block") != (block is not None):
            raise ValueError(f"fp8 weight strategy {strategy!r} with block {block!r} is not supported")
        self.strategy, self.block, self.scale_name = strategy, block, scale_name
        self.dynamic_activations, self.block_field = dynamic_activations, block_field
        self._scaled_mm = Fp8LinearMethod() if dynamic_activations and strategy != "block" else None

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        out_features = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(out_features, input_size_per_partition, dtype=FP8_DTYPE),
                              requires_grad=False)
        weight.weight_loader, weight.output_dim, weight.input_dim = weight_loader, 0, 1
        layer.register_parameter("weight", weight)
        attrs: dict[str, Any]
        if self.strategy == "block":
            check_block_fits_shard(layer, self.block, self.block_field, input_size_per_partition,
                                   output_partition_sizes, input_size, output_size)
            block_n, block_k = self.block
            shape = (-(-out_features // block_n), -(-input_size_per_partition // block_k))
            attrs = {"weight_loader": weight_loader, "output_dim": 0, "input_dim": 1, "packed_dim": 0,
                     "packed_factor": block_n}
        elif self.strategy == "channel":
            shape, attrs = (out_features, 1), {"weight_loader": weight_loader, "output_dim": 0}
        else:
            shape, attrs = (len(output_partition_sizes),), {"weight_loader": scalar_per_shard_loader}
        scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        for key, value in attrs.items():
            setattr(scale, key, value)
        layer.register_parameter(self.scale_name, scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """A per-tensor scale becomes per-channel [out, 1] (each fused sub-projection's
        rows get its value); the fp8 weight stays as loaded (no copy)."""
        if self.strategy != "tensor" or getattr(layer, self.scale_name).dim() == 2:
            return
        per_channel = per_channel_from_shards(getattr(layer, self.scale_name).data, layer.output_partition_sizes)
        setattr(layer, self.scale_name, nn.Parameter(per_channel, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight, scale = layer.weight, getattr(layer, self.scale_name)
        if scale.dim() == 1:  # per-tensor, before loading finished: one value per fused shard
            scale = per_channel_from_shards(scale, layer.output_partition_sizes)
        if self._scaled_mm is not None and x.is_cuda and scale.dim() == 2:
            method = self._scaled_mm
            if method._can_use_scaled_mm(x, weight):
                try:
                    return method._apply_scaled_mm(x, weight, scale, bias)
                except RuntimeError:  # an unsupported shape or arch: dequantise from now on
                    method.use_scaled_mm = False
        block_n, block_k = self.block if self.block is not None else (1, weight.shape[1])
        return fp8_linear(x, weight, scale, block_n, block_k, bias)


class Fp8CheckpointConfig(QuantizationConfig):
    """A native fp8 checkpoint's quantization_config (`quant_method: "fp8"`)."""

    name = "fp8"

    def __init__(self, block: tuple[int, int] | None, ignored: list[str]) -> None:
        self.block, self.ignored = block, ignored
        self.method = (Fp8CheckpointLinearMethod("block", block, "weight_scale_inv", True) if block is not None
                       else Fp8CheckpointLinearMethod("tensor", None, "weight_scale", True))

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> Fp8CheckpointConfig:
        q = hf_quant_config or {}
        scheme = q.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported; supported: "
                             "'dynamic' (static input scales are not served)")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; supported: 'e4m3'")
        block = q.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive integers")
            block = (block[0], block[1])
        ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
        if not isinstance(ignored, list) or not all(isinstance(i, str) for i in ignored):
            raise ValueError(f"quantization_config.ignored_layers must be a list of module names, got {ignored!r}")
        return cls(block, ignored)

    def get_linear_method(self, layer: nn.Module, prefix: str = "",
                          packed_modules_mapping: dict[str, tuple[str, str | int]] | None = None
                          ) -> LinearMethodBase | None:
        if prefix and not_converted(prefix, packed_modules_mapping, self.ignored):
            return None
        return self.method

    def moe_unsupported_reason(self, expert_names: list[list[str]] | None = None) -> str | None:
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> Any:
        """fp8 experts (fp8_moe.Fp8MoEMethod): block scales (`weight_scale_inv`), or
        without `weight_block_size` one `weight_scale` per projection."""
        if self.block is None:
            return Fp8MoEMethod("tensor", None, "weight_scale")
        return Fp8MoEMethod("block", self.block, "weight_scale_inv")

    def __repr__(self) -> str:
        return f"Fp8CheckpointConfig(weight_block_size={self.block}, ignored_layers={self.ignored})"
