"""The unquantised linear methods, one per platform.

`UnquantizedLinearMethod` is plain `F.linear` (CUDA, and the CPU with packing off).
`CPUUnquantizedLinearMethod` adds, after loading, a packed copy of the weight
(`models/layers/cpu_gemm.py`): a float32 weight packed by MKL, oneDNN or our AVX2
kernel (by CPU), a bfloat16/float16 one by oneDNN in its own dtype where the CPU has a
GEMM for it: the CPU counterpart of what vLLM's CPU backend does with oneDNN in
`process_weights_after_loading`. Both serve
the parallel linear layers and the LM head; `LayerBuildConfig` picks one per layer.

Memory: the packed copy is held next to the original weight, which stays for MKL's
large-batch path, a tied embedding and `state_dict()`; so packed weights take twice
their size. It is made in `process_weights_after_loading`, inside the worker's
"weights" memory pool, so KV-cache sizing sees it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.cpu_gemm import (PackedWeight, can_pack, lacks_native_gemm, native_half_gemm,
                                    packing_available, reusing_upcast_buffer, upcast_float32, upcast_gemm)
from models.layers.quantization.base import LinearMethodBase

logger = logging.getLogger(__name__)


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain F.linear on the full-precision weight."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class CPUUnquantizedLinearMethod(UnquantizedLinearMethod):
    """F.linear, with a packed copy of the weight for small batches once loaded.

    `packed` is None until `process_weights_after_loading`, and stays None for a weight
    that cannot be packed (no packing library, or a packed product that does not match
    F.linear on this build: the layout being independent of the row count is library
    behaviour, not an API promise, so each weight is checked when it is packed).

    A bfloat16/float16 weight is packed by oneDNN in its own dtype where the CPU has a
    GEMM for it (`native_half_gemm`: AVX-512 BF16/FP16, AMX), whatever `kernel` packs
    float32. On a CPU with none it is `upcast`: a packed float32 copy (oneDNN's, or the
    avx2 kernel's where that packs: `upcast_gemm`) computes every product in float32
    (the input cast up, the output back), which is what oneDNN would do anyway,
    converting the weight on each call. That copy is twice the weight's size.
    """

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel  # PACKED_GEMMS: the float32 one
        self.packed: PackedWeight | None = None
        self.upcast = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """(Re)pack `layer.weight`; idempotent, so code that changes weights after
        loading calls it again (`prepack_cpu_weights`)."""
        self.packed, self.upcast = None, False
        if lacks_native_gemm(layer.weight):
            weight32 = upcast_float32(layer.weight)
            packed = PackedWeight(weight32, upcast_gemm(self.kernel))
            if packed.verify(weight32):
                self.packed, self.upcast = packed, True
            return
        if native_half_gemm(layer.weight):
            kernel = "onednn"
        elif packing_available(self.kernel) and can_pack(layer.weight):
            kernel = self.kernel
        else:
            return
        try:
            packed = PackedWeight(layer.weight, kernel)
        except RuntimeError as e:  # a build of the library without this dtype's reorder
            logger.warning("%s cannot pack a %s %s weight (%s); using the plain path",
                           kernel, tuple(layer.weight.shape), layer.weight.dtype, e)
            return
        if not packed.verify(layer.weight):
            logger.warning("%s packed GEMM does not match F.linear for a %s %s weight; using the plain path",
                           kernel, tuple(layer.weight.shape), layer.weight.dtype)
            return
        self.packed = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, layer.weight, bias)
        if self.upcast:
            out = self.packed.linear_any_rows(x.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
        return self.packed.linear(x, layer.weight, bias)


def prepack_cpu_weights(model: nn.Module) -> int:
    """Re-pack every CPU-packed weight of `model` from its current value (the packed
    copies are snapshots: call this after changing weights in place). Returns how
    many weights are packed now."""
    count = 0
    with reusing_upcast_buffer():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, CPUUnquantizedLinearMethod):
                method.process_weights_after_loading(module)
                count += method.packed is not None
    return count
