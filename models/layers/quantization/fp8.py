"""Online fp8 (e4m3) weight quantisation with per-output-channel scales.

The checkpoint is loaded in the model dtype as usual; after loading, each linear
layer's weight W [out, in] (this rank's shard) becomes

    q = round_fp8(W / s),  s[o] = max_i |W[o, i]| / 448      (float32, shape [out, 1])

and the full-precision parameter is replaced, so the weight memory really falls
(1 byte per element + 4 bytes per output row, against 2 for bf16 / 4 for fp32).
Embeddings, norms and the LM head are left alone (they are not linear layers).

Forward: on CUDA GPUs with fp8 support (compute capability >= 8.9) and a bf16 input,
`torch._scaled_mm` with row-wise scales (activations quantised per token,
dynamically); if that call fails the layer falls back for good to the weight-only
path every other case takes: `fp8_kernels.fp8_linear` with per-channel scales (the
CPU's fp8 GEMV for decode rows and dequantised tiles for batches; the Triton GEMM on
CUDA), which never dequantises the whole weight: each weight value is q * s rounded
once to x's dtype.

Tensor parallelism needs nothing special: a column-parallel shard holds whole output
rows, so its scales are just its rows' scales; a row-parallel shard computes scales of
its own slice, and each rank scales its partial sum before the all-reduce.

A checkpoint that is already fp8 (config.json's `quantization_config` with
`quant_method: "fp8"`: per-tensor or 128x128-block scales, as DeepSeek-V3 and
Qwen3-FP8 ship) is not quantised here: the registry (`get_quantization_config`) hands
its settings to fp8_checkpoint.py.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig
from models.layers.quantization.fp8_kernels import fp8_linear

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
_MIN_SCALE = 1e-12  # an all-zero row gets this scale (its values stay exactly 0)
_ROWS_PER_CHUNK = 4096  # bounds the float32 scratch while quantising a big weight


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] float8_e4m3fn, scale [out, 1] float32) with weight ≈ q * scale."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 per-channel quantisation expects a 2-D weight, got shape {tuple(weight.shape)}")
    out_features = weight.shape[0]
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty((out_features, 1), dtype=torch.float32, device=weight.device)
    for start in range(0, out_features, _ROWS_PER_CHUNK):
        rows = weight[start : start + _ROWS_PER_CHUNK].to(torch.float32)
        s = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
        q[start : start + _ROWS_PER_CHUNK] = (rows / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[start : start + _ROWS_PER_CHUNK] = s
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)


def _scaled_mm_supported(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod(LinearMethodBase):
    """Quantises `layer.weight` after loading; `layer.weight_scale` holds the scales."""

    def __init__(self) -> None:
        self.use_scaled_mm: bool | None = None  # decided on first CUDA forward

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if weight.dtype == FP8_DTYPE:  # already done (a second call is a no-op)
            return
        q, scale = quantize_fp8_per_channel(weight.data)
        # Replace the Parameter (not .data) so the full-precision storage is freed.
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        del weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight, scale = layer.weight, getattr(layer, "weight_scale", None)
        if scale is None:  # not processed yet: still the full-precision weight
            return F.linear(x, weight, bias)
        if x.is_cuda and self._can_use_scaled_mm(x, weight):
            try:
                return self._apply_scaled_mm(x, weight, scale, bias)
            except RuntimeError as e:  # an unsupported shape/arch combination: dequantise from now on
                logger.warning("torch._scaled_mm failed (%s); fp8 layers fall back to the weight-only fp8 GEMM", e)
                self.use_scaled_mm = False
        return fp8_linear(x, weight, scale, 1, weight.shape[1], bias)

    def _can_use_scaled_mm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if self.use_scaled_mm is None:
            self.use_scaled_mm = _scaled_mm_supported(x.device)
        return (
            self.use_scaled_mm
            and x.dtype == torch.bfloat16
            and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0
        )

    @staticmethod
    def _apply_scaled_mm(
        x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = (x2.abs().amax(dim=-1, keepdim=True).to(torch.float32) / FP8_MAX).clamp(min=_MIN_SCALE)
        xq = (x2.to(torch.float32) / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        y = torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale, scale_b=scale.t(), bias=bias, out_dtype=x.dtype
        )
        return y.reshape(*x.shape[:-1], weight.shape[0])


class Fp8Config(QuantizationConfig):
    """`quantization="fp8"` on a full-precision checkpoint: every parallel linear layer
    gets `Fp8LinearMethod`. A checkpoint already in fp8 (config.json's
    quantization_config with `quant_method: "fp8"`) is served by
    fp8_checkpoint.Fp8CheckpointConfig instead (the registry's choice:
    `get_quantization_config`)."""

    name = "fp8"

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> QuantizationConfig:
        """Online quantisation: hf_quant_config must be None. Raises ValueError for a
        checkpoint's quantization_config, which fp8_checkpoint.Fp8CheckpointConfig reads."""
        if hf_quant_config is not None:
            raise ValueError("Fp8Config quantises a full-precision checkpoint online; a checkpoint with "
                             "quantization_config quant_method='fp8' is read by Fp8CheckpointConfig")
        return cls()

    def get_linear_method(self, layer: nn.Module, prefix: str = "",
                          packed_modules_mapping: dict[str, tuple[str, str | int]] | None = None
                          ) -> LinearMethodBase | None:
        current = getattr(layer, "quant_method", None)  # named now: keep what it was built with
        return current if isinstance(current, Fp8LinearMethod) else Fp8LinearMethod()
