"""Quantisation methods for the parallel linear layers.

`get_quantization_config(name)` turns `EngineConfig.quantization` (None | "fp8") into a
`QuantizationConfig`. The model loader builds the model inside
`set_current_quant_config(...)`, and every `LinearBase` created meanwhile asks the
current config for its method (`UnquantizedLinearMethod` when there is none), so the
model files need not thread the config through every constructor.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod

QUANTIZATION_METHODS: tuple[str, ...] = ("fp8",)

_CURRENT: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar("quant_config", default=None)


def get_quantization_config(name: str | QuantizationConfig | None) -> QuantizationConfig | None:
    """The config for a method name; ValueError lists the supported ones."""
    if name is None or isinstance(name, QuantizationConfig):
        return name
    if name == "fp8":
        from models.layers.quantization.fp8 import Fp8Config

        return Fp8Config()
    raise ValueError(f"quantization={name!r} is not supported; supported methods: {list(QUANTIZATION_METHODS)}")


def get_current_quant_config() -> QuantizationConfig | None:
    return _CURRENT.get()


@contextlib.contextmanager
def set_current_quant_config(config: str | QuantizationConfig | None) -> Iterator[QuantizationConfig | None]:
    """Linear layers built inside use `config` (a name or a QuantizationConfig)."""
    resolved = get_quantization_config(config)
    token = _CURRENT.set(resolved)
    try:
        yield resolved
    finally:
        _CURRENT.reset(token)


__all__ = [
    "LinearMethodBase",
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "get_current_quant_config",
    "get_quantization_config",
    "set_current_quant_config",
]
