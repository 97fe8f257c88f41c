"""compressed-tensors schemes: one per weight/activation recipe, each its own file.

`get_scheme(group_name, weights, input_activations, fmt)` picks the scheme class for a
config group's `weights` and `input_activations` dicts (llm-compressor's
QuantizationArgs) and builds it; a recipe no scheme serves is a ValueError naming the
group, the field and the value. Imports are lazy: a scheme's kernels load only when a
checkpoint uses it.
"""

from __future__ import annotations

import importlib
from typing import Any

from models.layers.quantization.compressed_tensors.schemes.base import CompressedTensorsScheme

_SCHEMES: dict[str, str] = {
    # int4/int8 weights, 16-bit activations (W4A16, W8A16), group or channel, sym or asym
    "wNa16": "models.layers.quantization.compressed_tensors.schemes.wna16:CompressedTensorsWNA16",
    # int8 weights (per channel) and int8 activations quantised per token, dynamically
    "w8a8_int8": "models.layers.quantization.compressed_tensors.schemes.w8a8_int8:CompressedTensorsW8A8Int8",
    # fp8 weights (per channel, or 128x128 blocks), fp8 activations per token (or none: W8A16)
    "w8a8_fp8": "models.layers.quantization.compressed_tensors.schemes.w8a8_fp8:CompressedTensorsW8A8Fp8",
}


def _scheme_name(group: str, weights: dict[str, Any], acts: dict[str, Any] | None) -> str:
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind == "float":
        if bits != 8:
            raise ValueError(f"config_groups.{group}.weights.num_bits={bits!r}: float weights must be 8-bit (fp8)")
        return "w8a8_fp8"
    if kind != "int":
        raise ValueError(f"config_groups.{group}.weights.type={kind!r} is not supported; supported: 'int', 'float'")
    if acts is None:
        return "wNa16"
    if acts.get("type", "int") == "int" and acts.get("num_bits") == 8 and bits == 8:
        return "w8a8_int8"
    raise ValueError(f"config_groups.{group}: int{bits} weights with input_activations={acts!r} are not supported; "
                     "supported: W4A16/W8A16 (no input_activations), W8A8 int8 (8-bit int activations), FP8")


def get_scheme(group: str, weights: dict[str, Any], input_activations: dict[str, Any] | None,
               fmt: str | None) -> CompressedTensorsScheme:
    """The scheme for one config group; raises ValueError naming the field at fault."""
    if not isinstance(weights, dict):
        raise ValueError(f"config_groups.{group}.weights must be an object, got {weights!r}")
    module, cls_name = _SCHEMES[_scheme_name(group, weights, input_activations)].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    return cls(group, weights, input_activations, fmt)


__all__ = ["CompressedTensorsScheme", "get_scheme"]
