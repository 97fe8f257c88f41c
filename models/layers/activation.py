"""Gated activations."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from config.utils import ConfigError


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused gate_up projection.

    Computed in place in the gate half of `x` (which the caller must not reuse) and
    returned as a strided view of it: the next linear layer reads a strided input at
    no cost, and a prefill-sized step saves two large allocations (fresh pages, i.e.
    page faults, on the CPU).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        gate = F.silu(x[..., :d], inplace=True)
        return gate.mul_(x[..., d:])


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] for the fused gate_up projection (GeGLU), with the
    exact ("none") or tanh-approximate ("tanh") GELU, as `F.gelu(approximate=...)`. The
    product is written into the GELU's fresh output; `x` is left as it is."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximation {approximate!r} is not one of 'none', 'tanh'")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate).mul_(x[..., d:])


# transformers' ACT2FN names (config.json's `hidden_act` / `hidden_activation`) -> a
# factory of the gated module that applies it to the gate half of a fused gate_up output.
_ACT_AND_MUL: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul_fn(field: str, name: object) -> nn.Module:
    """The gated activation for config.json's `field` = `name` (a transformers ACT2FN
    name). Called while building a model, on every rank. Raises ConfigError naming the
    field and value for a name not in the table, rather than running another function."""
    factory = _ACT_AND_MUL.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ConfigError(f"{field}={name!r} is not supported; supported: {sorted(_ACT_AND_MUL)}")
    return factory()
