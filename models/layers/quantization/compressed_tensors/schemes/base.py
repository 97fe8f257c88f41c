"""The interface of a compressed-tensors scheme (vLLM's shape)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import nn


class CompressedTensorsScheme(ABC):
    """How one config group's layers store, repack and apply their weights.

    Built once per config group from its `weights` / `input_activations` args and the
    checkpoint's `format`; the constructor validates them (ValueError naming
    `config_groups.<group>.<field>` and the value) and has no other effect. The three
    methods are `LinearMethodBase`'s (models/layers/quantization/base.py), called on
    every rank with this rank's shard.
    """

    def __init__(self, group: str, weights: dict[str, Any], input_activations: dict[str, Any] | None,
                 fmt: str | None) -> None:
        self.group = group
        self.weights = weights
        self.input_activations = input_activations
        self.format = fmt

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        """Register the checkpoint's tensors for this rank's shard (see LinearMethodBase)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Repack for the platform's kernel, replacing (never duplicating) the tensors."""

    @abstractmethod
    def apply_weights(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T (+ bias) for this rank's shard."""
