"""Quantisation methods for the parallel linear layers, by vLLM's names.

`get_quantization_config(name, hf_quant_config)` turns the resolved
`ModelConfig.quantization` (a method name) and the checkpoint's `quantization_config`
(config.json's, or quantize_config.json's; None for online quantisation) into a
`QuantizationConfig`. The engine calls it once at resolution, so a bad method, bit
width or scheme is a ConfigError before any worker starts; the model loader calls it
again in every worker and hands the result to the layers through
`models.layers.build_config.LayerBuildConfig` while the model is built.

The registry is lazy: a method's module is imported only when a model uses it.
"""

from __future__ import annotations

import importlib
from typing import Any

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig

# name -> "module:class"; the class has `from_config(hf_quant_config: dict | None)`.
# For a method that is also applied online, this class serves a full-precision checkpoint
# (hf_quant_config None) and _SERIALIZED's a checkpoint already quantised by it.
_METHODS: dict[str, str] = {
    "fp8": "models.layers.quantization.fp8:Fp8Config",
    "gptq": "models.layers.quantization.gptq:GPTQConfig",
    "awq": "models.layers.quantization.awq:AWQConfig",
    "compressed-tensors": "models.layers.quantization.compressed_tensors:CompressedTensorsConfig",
    "gguf": "models.layers.quantization.gguf:GGUFConfig",
}
_SERIALIZED: dict[str, str] = {
    "fp8": "models.layers.quantization.fp8_checkpoint:Fp8CheckpointConfig",
}
QUANTIZATION_METHODS: tuple[str, ...] = tuple(_METHODS)
#: Methods `EngineConfig(quantization=...)` can apply to a full-precision checkpoint;
#: the others describe a checkpoint that is already quantised.
ONLINE_QUANTIZATION_METHODS: tuple[str, ...] = ("fp8",)


def get_quantization_config(name: str | QuantizationConfig | None,
                            hf_quant_config: dict[str, Any] | None = None) -> QuantizationConfig | None:
    """The config for a method name and the checkpoint's settings. Raises ValueError
    naming the method, or the `quantization_config` field and value it cannot serve."""
    if name is None or isinstance(name, QuantizationConfig):
        return name
    target = _METHODS.get(name)
    if target is None:
        raise ValueError(f"quantization={name!r} is not supported; supported methods: {list(QUANTIZATION_METHODS)}")
    if hf_quant_config is not None:
        target = _SERIALIZED.get(name, target)
    module, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    return cls.from_config(hf_quant_config)


__all__ = ["LinearMethodBase", "ONLINE_QUANTIZATION_METHODS", "QUANTIZATION_METHODS", "QuantizationConfig",
           "get_quantization_config"]
