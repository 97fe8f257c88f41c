"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
