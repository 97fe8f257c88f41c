"""Quantisation methods for the parallel linear layers.

`get_quantization_config(name)` turns `EngineConfig.quantization` (None | "fp8") into a
`QuantizationConfig`. The model loader hands it to the layers through
`models.layers.build_config.LayerBuildConfig` while the model is built.
"""

from __future__ import annotations

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig

QUANTIZATION_METHODS: tuple[str, ...] = ("fp8",)


def get_quantization_config(name: str | QuantizationConfig | None) -> QuantizationConfig | None:
    """The config for a method name; ValueError lists the supported ones."""
    if name is None or isinstance(name, QuantizationConfig):
        return name
    if name == "fp8":
        from models.layers.quantization.fp8 import Fp8Config

        return Fp8Config()
    raise ValueError(f"quantization={name!r} is not supported; supported methods: {list(QUANTIZATION_METHODS)}")


__all__ = ["LinearMethodBase", "QUANTIZATION_METHODS", "QuantizationConfig", "get_quantization_config"]
