"""CompressedTensorsConfig: a compressed-tensors checkpoint's `quantization_config`.

llm-compressor writes `config_groups` (each: `targets`, `weights`, `input_activations`,
and a `format`), a top-level `format`, and an `ignore` list of checkpoint module names
(or `re:` regexes) left unquantised. Each linear layer gets the scheme of the group
whose targets match it (models/layers/quantization/compressed_tensors/schemes/),
wrapped in `CompressedTensorsLinearMethod`; an ignored layer gets None (unquantised).
A fused layer (qkv_proj, gate_up_proj) stands for several checkpoint modules, which must
all be ignored or all fall in the same group. What we do not serve is refused at
resolution with a ValueError naming the field and value: an unknown format, a
KV-cache scheme, sparsity, output activations, a quantisation status other than
compressed/frozen. A mixture-of-experts checkpoint's experts take the scheme of the
group that targets every Linear, served where it is FP8 per channel or in blocks
(fp8_moe.Fp8MoEMethod, `weight_scale`: llm-compressor's FP8_DYNAMIC and FP8_BLOCK MoE
checkpoints; per tensor too) or W4A16/W8A16 without act-order (wna16_moe.WNA16MoEMethod),
and refused otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig
from models.layers.quantization.compressed_tensors.schemes import CompressedTensorsScheme, get_scheme
from models.layers.quantization.compressed_tensors.schemes.wna16 import CompressedTensorsWNA16
from models.layers.quantization.fp8_moe import Fp8MoEMethod
from models.layers.quantization.wna16_moe import WNA16ExpertFormat, WNA16MoEMethod

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


class CompressedTensorsLinearMethod(LinearMethodBase):
    """The linear method of one layer: its group's scheme does the work."""

    def __init__(self, scheme: CompressedTensorsScheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, weight_loader: Any) -> None:
        self.scheme.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                                   params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.scheme.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.scheme.apply_weights(layer, x, bias)


def _matches(name: str, pattern: str) -> bool:
    """A target or ignore entry: `re:<regex>` (matched from the start, as llm-compressor
    does), "Linear" (every linear layer), or a module name (or its dotted suffix)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith("." + pattern)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, groups: dict[str, tuple[list[str], CompressedTensorsScheme]], ignore: list[str]) -> None:
        self.groups = groups
        self.ignore = ignore

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> CompressedTensorsConfig:
        if not hf_quant_config:
            raise ValueError("quantization='compressed-tensors' needs the checkpoint's quantization_config")
        q = hf_quant_config
        for field, allowed in (("kv_cache_scheme", (None,)), ("sparsity_config", (None, {}))):
            if q.get(field) not in allowed:
                raise ValueError(f"quantization_config.{field}={q.get(field)!r} is not supported")
        status = q.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise ValueError(f"quantization_config.quantization_status={status!r} is not supported; "
                             "supported: 'compressed', 'frozen'")
        groups_cfg = q.get("config_groups")
        if not isinstance(groups_cfg, dict) or not groups_cfg:
            raise ValueError(f"quantization_config.config_groups must be a non-empty object, got {groups_cfg!r}")
        groups: dict[str, tuple[list[str], CompressedTensorsScheme]] = {}
        for group, spec in groups_cfg.items():
            if not isinstance(spec, dict):
                raise ValueError(f"quantization_config.config_groups.{group} must be an object")
            fmt = spec.get("format") or q.get("format")
            if fmt not in FORMATS:
                raise ValueError(f"quantization_config.config_groups.{group}.format={fmt!r} is not supported; "
                                 f"supported: {list(FORMATS)}")
            if spec.get("output_activations") is not None:
                raise ValueError(f"quantization_config.config_groups.{group}.output_activations is not supported")
            targets = spec.get("targets") or []
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
                raise ValueError(f"quantization_config.config_groups.{group}.targets must be a list of names, "
                                 f"got {targets!r}")
            try:
                scheme = get_scheme(group, spec.get("weights"), spec.get("input_activations"), fmt)
            except ValueError as e:
                raise ValueError(f"quantization_config.{e}") from None
            groups[group] = (targets, scheme)
        ignore = q.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise ValueError(f"quantization_config.ignore must be a list of names, got {ignore!r}")
        return cls(groups, ignore)

    def _group_of(self, name: str) -> str | None:
        """The group whose targets match checkpoint module `name`, None if ignored."""
        if any(_matches(name, pattern) for pattern in self.ignore):
            return None
        specific = [g for g, (targets, _) in self.groups.items() if any(t != "Linear" and _matches(name, t)
                                                                         for t in targets)]
        if specific:
            return specific[0]
        return self._linear_group()

    def _linear_group(self) -> str | None:
        """The first group that targets every Linear (a layer's before it is named, and the
        experts'), or None."""
        return next((g for g, (targets, _) in self.groups.items() if "Linear" in targets), None)

    def _expert_scheme(self) -> tuple[str | None, CompressedTensorsScheme | None]:
        """The group (and scheme) the experts fall in: the one targeting every Linear."""
        group = self._linear_group()
        return group, self.groups[group][1] if group is not None else None

    def moe_unsupported_reason(self) -> str | None:
        group, scheme = self._expert_scheme()
        if isinstance(scheme, CompressedTensorsWNA16):
            if scheme.has_g_idx:
                return (f"config_groups.{group}.weights.actorder='group': act-order (g_idx) experts are not "
                        "supported")
            return None
        method = getattr(scheme, "method", None)
        if getattr(method, "strategy", None) in ("channel", "block", "tensor"):
            return None
        what = (f"config_groups.{group} is {type(scheme).__name__} with strategy "
                f"{getattr(method, 'strategy', None)!r}" if group is not None else "no config group targets 'Linear'")
        return f"{what}; experts are served as fp8 or as int4/int8 weight-only (pack-quantized) only"

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> Any:
        """The experts' method for the group targeting every Linear: int4/int8
        weight-only (wna16_moe.WNA16MoEMethod) or fp8 per channel, per tensor or in
        blocks (fp8_moe.Fp8MoEMethod, `weight_scale`); None where
        `moe_unsupported_reason` gives a reason (refused at resolution)."""
        if self.moe_unsupported_reason() is not None:
            return None
        group, scheme = self._expert_scheme()
        if isinstance(scheme, CompressedTensorsWNA16):
            return WNA16MoEMethod(WNA16ExpertFormat.compressed_tensors(scheme.symmetric), scheme.bits,
                                  scheme.group_size, f"config_groups.{group}.weights.group_size")
        method = scheme.method
        return Fp8MoEMethod(method.strategy, method.block, "weight_scale",
                            f"config_groups.{group}.weights.block_structure")

    def get_linear_method(self, layer: nn.Module, prefix: str = "",
                          packed_modules_mapping: dict[str, tuple[str, str | int]] | None = None
                          ) -> LinearMethodBase | None:
        if not prefix:  # while building: the "Linear" group's, until the layer is named
            group = self._linear_group()
            return CompressedTensorsLinearMethod(self.groups[group][1]) if group is not None else None
        parent, _, leaf = prefix.rpartition(".")
        parts = [sub for sub, (fused, _) in (packed_modules_mapping or {}).items() if fused == leaf]
        names = [f"{parent}.{sub}" if parent else sub for sub in parts] or [prefix]
        groups = {self._group_of(n) for n in names}
        if len(groups) > 1:
            raise ValueError(f"quantization_config: the checkpoint modules {names}, which {prefix} fuses, fall in "
                             f"different groups or are only partly ignored ({sorted(map(str, groups))})")
        group = groups.pop()
        if group is None:
            return None
        current = getattr(layer, "quant_method", None)
        if isinstance(current, CompressedTensorsLinearMethod) and current.scheme is self.groups[group][1]:
            return current
        return CompressedTensorsLinearMethod(self.groups[group][1])
