"""RMSNorm, optionally fused with the residual add (the vLLM calling convention).

On the CPU one C call does both (`cpu_ops.py`) where it can; elsewhere, and as its
fallback, torch ops with the same roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import cpu_ops
from models.layers.weight_utils import default_weight_loader, set_weight_attrs


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        # Normalise in float32 and cast back before the scale, as the HF reference does,
        # so half-precision results agree bit for bit in spirit, not just roughly.
        return self.weight * F.rms_norm(x.to(torch.float32), shape, eps=self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the
        sum written into `x` (a layer output the caller no longer needs), as vLLM's fused
        add-norm does."""
        kernel = cpu_ops.load() if x.device.type == "cpu" else None
        if kernel is not None:
            out = kernel.rms_norm(x, residual, self.weight, self.eps)
            if out is not None:
                return out if residual is None else (out, x)
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x
