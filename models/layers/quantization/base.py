"""The quantisation interfaces the parallel linear layers dispatch through.

A `QuantizationConfig` (one per model, chosen by `EngineConfig(quantization=...)`)
hands each linear layer a `LinearMethodBase` (through `LayerBuildConfig.linear_method`;
layers it leaves alone get the platform's unquantised method). The layer creates and
loads its weights as usual; once every weight is in place,
`model_loader.utils.process_weights_after_loading` calls
`layer.quant_method.process_weights_after_loading(layer)`, which may replace the
layer's parameters (e.g. by fp8 ones) or add derived copies (CPU packing), and every
forward goes through `layer.quant_method.apply(layer, x, bias)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethodBase(ABC):
    """How one linear layer stores and applies its weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Repack `layer`'s loaded weights; called once, after the strict all-loaded check."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x W^T (+ bias) for this rank's shard of the weight."""


class QuantizationConfig(ABC):
    """Model-wide quantisation settings; picks a method per layer."""

    name: str = ""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethodBase | None:
        """The method for `layer`, or None to leave it unquantised."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
