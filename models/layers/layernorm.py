"""RMSNorm, optionally fused with the residual add (the vLLM calling convention).

On the CPU one C call does both (`cpu_ops.py`) where it can; elsewhere, and as its
fallback, torch ops with the same roundings. A norm can also take the all-reduce of the
row-parallel layer before it (`all_reduce_input`); on the CPU's shared-memory path the
all-reduce, the add and the norm are then one kernel call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from distributed.communication_op import tensor_model_parallel_all_reduce_rms_norm
from models.layers import cpu_ops
from models.layers.weight_utils import copy_checked, default_weight_loader, set_weight_attrs


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
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, all_reduce_input: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the
        sum written into `x` (a layer output the caller no longer needs), as vLLM's fused
        add-norm does.

        With `all_reduce_input`, x is this rank's partial sum (of a layer built with
        `reduce_results=False`) and is summed over the TP ranks first; the result is then
        always the pair (norm(s), s), s = sum (+ residual), written into x. A collective:
        every rank calls it alike."""
        if all_reduce_input:
            return self._all_reduce_forward(x, residual)
        kernel = cpu_ops.load() if x.device.type == "cpu" else None
        if kernel is not None:
            out = kernel.rms_norm(x, residual, self.weight, self.eps)
            if out is not None:
                return out if residual is None else (out, x)
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x

    def _all_reduce_forward(self, x: torch.Tensor,
                            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if get_tensor_model_parallel_world_size() > 1:
            kernel = cpu_ops.load() if x.device.type == "cpu" else None
            if kernel is not None:
                fused = tensor_model_parallel_all_reduce_rms_norm(x, residual, self.weight, self.eps,
                                                                  kernel.norm_address)
                if fused is not None:
                    return fused
            x = tensor_model_parallel_all_reduce(x)
        if residual is None:
            return self.forward(x), x
        return self.forward(x, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, `rms_norm(x) * (1 + w)` with the checkpoint's `w`.

    The weight loader stores `1 + w` (added in float32, then cast to the model dtype),
    so the forward, the fused CPU kernels and the fused all-reduce + norm are the plain
    RMSNorm's, unchanged. In float32 the scale equals transformers' `1 + w` exactly; in
    a half dtype it is rounded once to that dtype (transformers keeps it in float32), an
    error of the order of the output's own rounding. Whoever reads this parameter back
    (a sharded-state save) gets `1 + w`; reloading it through `load_weights` expects the
    checkpoint's `w`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = self._offset_weight_loader

    @staticmethod
    def _offset_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        copy_checked(param.data, (loaded_weight.to(torch.float32) + 1.0).to(param.dtype), "Gemma RMSNorm weight")
