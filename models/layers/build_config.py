"""LayerBuildConfig: the model-wide choices each layer reads while the model is built.

The model loader builds the architecture inside `set_layer_build_config(...)`; every
linear layer created meanwhile asks it for its method (the quantisation config's, else
the platform's unquantised one), so model files never thread these choices through
their constructors and never branch on a platform. A layer built outside that context
gets the defaults: unquantised, CPU, no packing. One process builds one model at a
time; the context is a `ContextVar`, set and reset around the construction only.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

from torch import nn

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig


@dataclass(frozen=True)
class LayerBuildConfig:
    quant_config: QuantizationConfig | None = None
    device_type: str = "cpu"  # where the weights will live: "cpu" | "cuda"
    # Linear weights on the CPU are packed in place (models/layers/unquantized.py): faster
    # GEMMs (decode above all), no extra memory (MKL, when chosen, keeps a copy beside).
    cpu_prepack_weights: bool = False
    cpu_packed_gemm: str = "onednn"  # which kernel packs: cpu_gemm.PACKED_GEMMS (cpu_gemm.default_packed_gemm)

    def linear_method(self, layer: nn.Module) -> LinearMethodBase:
        """The quantisation config's method for `layer`, else the unquantised one."""
        method = self.quant_config.get_linear_method(layer) if self.quant_config is not None else None
        return method if method is not None else self.unquantized_linear_method()

    def unquantized_linear_method(self) -> LinearMethodBase:
        """The platform's full-precision product (also the LM head's, which is never
        quantised)."""
        from models.layers.unquantized import CPUUnquantizedLinearMethod, UnquantizedLinearMethod

        if self.device_type == "cpu" and self.cpu_prepack_weights:
            return CPUUnquantizedLinearMethod(self.cpu_packed_gemm)
        return UnquantizedLinearMethod()


_CURRENT: contextvars.ContextVar[LayerBuildConfig] = contextvars.ContextVar(
    "layer_build_config", default=LayerBuildConfig()
)


def get_layer_build_config() -> LayerBuildConfig:
    return _CURRENT.get()


@contextlib.contextmanager
def set_layer_build_config(config: LayerBuildConfig) -> Iterator[LayerBuildConfig]:
    """Layers built inside read `config`; the previous one comes back after."""
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)
