"""Pre-packed float32 GEMM for small batches on CPU (the decode steps).

For a decode step a linear layer multiplies a few rows (one per running sequence) by
its whole weight. MKL's ordinary sgemm re-packs the weight into its kernel layout on
every call, and for a handful of rows that packing costs as much as the product; a
weight packed once, after loading, removes it (1.4-2x faster per layer at 8-64 rows on
the 2-core development VM). For many rows (prefill) the plain path is as fast or
faster, so `PackedWeight.linear` dispatches on the row count. This is the CPU
counterpart of what vLLM's CPU backend does with oneDNN in
`process_weights_after_loading`.

Called from `model_loader.utils.process_weights_after_loading` on every rank whose
weights are float32 on the CPU (`EngineConfig(cpu_prepack_weights=False)` turns it
off). Memory: the packed copy is held next to the original weight, which stays for the
large-batch path, the tied embedding and `state_dict()` (sharded-state saving); so the
linear weights take twice their size. The copy is made inside the worker's "weights"
memory pool, so KV-cache sizing sees it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.linear import LinearBase
from models.layers.quantization.base import UnquantizedLinearMethod
from models.layers.vocab_parallel_embedding import ParallelLMHead

logger = logging.getLogger(__name__)

# Up to this many rows the packed product wins: a 12-layer decode step's linears on the
# 2-core VM take 63 ms packed vs 94 ms plain at 64 rows, 72 vs 72 at 96, and above that
# the plain sgemm is as fast or faster.
PACKED_MAX_ROWS = 96
# The row count MKL is told when packing. The packed layout of the weight does not
# depend on it (checked at pack time, see PackedWeight.verify), only the op's
# bookkeeping does, so every call passes its own row count.
_PACK_HINT_ROWS = 32


def mkl_packing_available() -> bool:
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


class PackedWeight:
    """An MKL-packed copy of one [out, in] float32 weight; `linear` computes x W^T (+ b)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`weight` must be the tensor this was packed from (its shape and the
        large-batch path use it)."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or rows > PACKED_MAX_ROWS or x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, weight, bias, rows)

    def verify(self, weight: torch.Tensor) -> bool:
        """Whether the packed product matches F.linear for a few row counts: the
        packed layout being independent of the row count is MKL behaviour, not an API
        promise, so `prepack_cpu_weights` checks it on a model's first weight rather than
        assuming it."""
        generator = torch.Generator().manual_seed(0)
        for rows in (1, 7, _PACK_HINT_ROWS + 1):
            x = torch.randn(rows, weight.shape[1], generator=generator)
            expected = F.linear(x, weight)
            got = torch.ops.mkl._mkl_linear(x, self.packed, weight, None, rows)
            tolerance = 1e-4 * (1.0 + expected.abs().max().item())
            if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=tolerance):
                return False
        return True


def prepack_cpu_weights(model: nn.Module) -> int:
    """Give every unquantised float32 CPU linear layer, and the LM head, a packed copy
    of its weight. Returns how many weights were packed (0 when MKL packing is not
    available or a check fails, in which case the plain path is used everywhere).

    The copies are snapshots: code that changes weights after loading must call this
    again (it replaces the old copies) or load with `cpu_prepack_weights=False`."""
    if not mkl_packing_available():
        return 0
    targets = [
        m
        for m in model.modules()
        if (isinstance(m, LinearBase) and isinstance(m.quant_method, UnquantizedLinearMethod))
        or isinstance(m, ParallelLMHead)
    ]
    targets = [m for m in targets if can_pack(m.weight)]
    packed: list[tuple[nn.Module, PackedWeight]] = []
    for module in targets:
        weight = PackedWeight(module.weight)
        if not packed and not weight.verify(module.weight):
            logger.warning("MKL packed GEMM does not match F.linear on this build; using the plain path")
            return 0
        packed.append((module, weight))
    for module, weight in packed:
        if isinstance(module, ParallelLMHead):
            module.packed_weight = weight
        else:
            module.quant_method = PackedUnquantizedLinearMethod(weight)
    return len(packed)


class PackedUnquantizedLinearMethod(UnquantizedLinearMethod):
    """`UnquantizedLinearMethod` with an MKL-packed copy for small batches."""

    def __init__(self, packed: PackedWeight) -> None:
        self.packed = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.packed.linear(x, layer.weight, bias)
