"""The quantisation interfaces the parallel linear layers dispatch through.

A `QuantizationConfig` (one per model: `EngineConfig(quantization=...)`, or the
checkpoint's own `quantization_config`) hands each linear layer a `LinearMethodBase`
(through `LayerBuildConfig.linear_method`; layers it leaves alone get the platform's
unquantised method). vLLM's shape, in three steps, on every rank:

1. `create_weights` registers the layer's parameters in the checkpoint's layout, for
   this rank's shard, tagging each with the dims the layer shards (`output_dim`,
   `input_dim`, and `packed_dim`/`packed_factor` where several values share one stored
   element) so that the layer's `weight_loader` slices it (models/layers/linear.py), or
   giving it a `weight_loader` of its own.
2. Once every weight is in place, `model_loader.utils.process_weights_after_loading`
   calls `process_weights_after_loading(layer)`, which may replace the parameters by
   the platform's layout (fp8 values, CPU packing, a kernel's tiles): replace, never
   keep a second copy, and keep every tensor the layer holds a registered parameter or
   buffer so that `state_dict()`, sleep mode and memory accounting see it.
3. Every forward goes through `apply(layer, x, bias)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import nn


class LinearMethodBase(ABC):
    """How one linear layer stores and applies its weight."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        """Register this rank's parameters on `layer` (called once, from the layer's
        constructor, on the loader's default device). `output_partition_sizes` are this
        rank's widths of the sub-projections the layer fuses (q, k, v; gate, up);
        `input_size`/`output_size` are the full, unsharded sizes. The default: the plain
        `weight` [sum(output_partition_sizes), input_size_per_partition] in `params_dtype`."""
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        weight.weight_loader = weight_loader
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Repack `layer`'s loaded weights; called once, after the strict all-loaded check."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias) for this rank's shard of the weight."""


class QuantizationConfig(ABC):
    """Model-wide quantisation settings; picks a method per layer."""

    name: str = ""

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> QuantizationConfig:
        """The config for the checkpoint's `quantization_config` (None: quantise online,
        for methods that can). Raises ValueError naming the field and value it cannot
        serve."""
        if hf_quant_config is not None:
            raise ValueError(f"quantization {cls.name!r} takes no checkpoint quantization_config")
        return cls()

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str = "",
                          packed_modules_mapping: dict[str, tuple[str, str | int]] | None = None
                          ) -> LinearMethodBase | None:
        """The method for `layer`, or None to leave it unquantised. Called twice per
        layer: while it is built, with no `prefix` (the layer's name is not known yet),
        then by the model loader with its module name ("model.layers.0.self_attn.qkv_proj")
        and the model's `packed_modules_mapping` (checkpoint sub-module -> (fused module,
        shard id)), from which a config that names checkpoint modules (an ignore list)
        finds the names a fused layer stands for."""

    def get_embedding_method(self, role: str) -> Any:
        """The method holding a vocabulary table (`role`: "embed_tokens" or "lm_head"),
        or None to leave it plain (every format but GGUF, which keeps its tables in
        blocks: models/layers/vocab_parallel_embedding.py)."""
        return None

    def moe_unsupported_reason(self, expert_names: list[list[str]] | None = None) -> str | None:
        """Why this config cannot serve a mixture-of-experts checkpoint's experts, or None
        where `get_moe_method` serves them. `expert_names`: expert 0's (gate, up, down)
        checkpoint module names in each sparse layer, where the architecture is known
        (models/moe_utils.py `MoEForCausalLM.expert_checkpoint_names`), for a config that
        places experts by name. The engine asks at resolution, and refuses such a
        checkpoint with this reason before any worker starts; the model asks again as
        it is built."""
        return ("FusedMoE holds experts in full precision, fp8 (native or compressed-tensors), int4/int8 "
                "weight-only (GPTQ, AWQ, compressed-tensors), int8 (compressed-tensors W8A8) or GGUF blocks only; "
                "this format has no experts' method")

    #: Whether the experts' method depends on the layer's name (GGUF: types per layer): the
    #: model loader then asks `get_moe_method` again with each FusedMoE's name before loading.
    selects_moe_by_name: bool = False

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> Any:
        """The FusedMoE method (models/layers/fused_moe/moe_method.py's
        FusedMoEMethodBase) for `layer`'s experts, or None for full-precision experts;
        called while the layer is built (no `prefix`), and with its module name
        ("model.layers.0.mlp.experts") where `selects_moe_by_name`. An online method (a
        full-precision checkpoint) leaves the experts as they are."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
