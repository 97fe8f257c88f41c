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
compressed/frozen. A mixture-of-experts layer's experts take the scheme of the group
their projections fall in, resolved by name as vLLM does (expert 0's gate, up and down
projections: the group targeting every Linear unless a target or `ignore` entry names
them; ignored, or in no group, they stay in full precision; judged at resolution from
the architecture's expert names). Served: FP8 per channel,
per tensor or in blocks (fp8_moe.Fp8MoEMethod, `weight_scale`: llm-compressor's
FP8_DYNAMIC and FP8_BLOCK MoE checkpoints), W4A16/W8A16 without act-order
(wna16_moe.WNA16MoEMethod), and W8A8 int8 (int8_moe.Int8MoEMethod: RedHatAI's
`quantized.w8a8` MoE checkpoints, their activations quantised per token as the dense
W8A8 layers' are). Other schemes (act-order int4/int8, fp8 other than per channel,
tensor or block) are refused where the experts fall in them, at resolution and again
as the loader names each layer.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from models.layers.quantization.base import LinearMethodBase, QuantizationConfig
from models.layers.quantization.compressed_tensors.schemes import CompressedTensorsScheme, get_scheme
from models.layers.quantization.compressed_tensors.schemes.w8a8_int8 import CompressedTensorsW8A8Int8
from models.layers.quantization.compressed_tensors.schemes.wna16 import CompressedTensorsWNA16
from models.layers.quantization.fp8_moe import Fp8MoEMethod
from models.layers.quantization.int8_moe import Int8MoEMethod
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
        self._moe_methods: dict[str, Any] = {}  # the experts' method of each group, made once asked

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

    def _common_group(self, names: list[str], what: str) -> str | None:
        """The one group (None: ignored) of checkpoint modules `names`, which one layer
        holds; ValueError, naming them as `what`, where they fall in several."""
        groups = {self._group_of(name) for name in names}
        if len(groups) > 1:
            raise ValueError(f"quantization_config: {what} fall in different groups or are only partly ignored "
                             f"({sorted(map(str, groups))})")
        return groups.pop()

    def _linear_group(self) -> str | None:
        """The first group that targets every Linear (a layer's before it is named, and the
        experts'), or None."""
        return next((g for g, (targets, _) in self.groups.items() if "Linear" in targets), None)

    #: Targets and `ignore` may name the experts' projections: the loader asks again by name.
    selects_moe_by_name = True

    def _moe_reason(self, group: str) -> str | None:
        """Why group `group`'s scheme cannot hold experts, or None."""
        scheme = self.groups[group][1]
        if isinstance(scheme, CompressedTensorsWNA16):
            return (f"config_groups.{group}.weights.actorder='group': act-order (g_idx) experts are not supported"
                    if scheme.has_g_idx else None)
        if isinstance(scheme, CompressedTensorsW8A8Int8):
            return None
        strategy = getattr(getattr(scheme, "method", None), "strategy", None)
        if strategy in ("channel", "block", "tensor"):
            return None
        return (f"config_groups.{group} is {type(scheme).__name__} with strategy {strategy!r}; experts are served "
                "as fp8, int8 (W8A8) or int4/int8 weight-only (pack-quantized) only")

    def moe_unsupported_reason(self, expert_names: list[list[str]] | None = None) -> str | None:
        """Whether the experts' groups can hold them: with `expert_names` (expert 0's
        projections in each sparse layer) the groups those names fall in, as the loader
        will resolve them (`get_moe_method`), so experts a target or `ignore` entry moves
        out of an unservable group are not refused; without, the group targeting every
        Linear. Projections that fall in several groups are a reason too."""
        if expert_names is None:
            groups = {self._linear_group()}
        else:
            try:
                groups = {self._common_group(names, f"the experts' projections {names}") for names in expert_names}
            except ValueError as e:
                return str(e).removeprefix("quantization_config: ")
        return next((reason for group in sorted(g for g in groups if g is not None)
                     if (reason := self._moe_reason(group)) is not None), None)

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> Any:
        """The experts' method, or None for full precision. While the layer is built (no
        `prefix`): that of the group targeting every Linear, None where that group cannot
        hold experts (a name may move them elsewhere; asked again when named). Named (`prefix`
        "model.layers.0.mlp.experts"), as vLLM resolves them: the group of expert 0's
        projections, `<prefix>.0.<name>` for the layer's `checkpoint_proj_names`; None
        where they are ignored or no group targets them. The methods: int4/int8
        weight-only (wna16_moe.WNA16MoEMethod), W8A8 int8 (int8_moe.Int8MoEMethod), fp8
        per channel, per tensor or in blocks (fp8_moe.Fp8MoEMethod, `weight_scale`);
        one per group, so that a layer named into the group it was built with keeps its
        method and tensors. ValueError where the three projections fall in different
        groups (or are partly ignored), or where their group cannot hold experts (naming
        it)."""
        if not prefix:
            group = self._linear_group()
            if group is None or self._moe_reason(group) is not None:
                return None
        else:
            names = [f"{prefix}.0.{proj}" for proj in getattr(layer, "checkpoint_proj_names",
                                                               ("gate_proj", "up_proj", "down_proj"))]
            group = self._common_group(names, f"the experts' projections {names}")
        if group is None:
            return None
        if (reason := self._moe_reason(group)) is not None:
            raise ValueError(f"quantization_config: {reason}")
        if group not in self._moe_methods:
            self._moe_methods[group] = self._new_moe_method(group)
        return self._moe_methods[group]

    def _new_moe_method(self, group: str) -> Any:
        scheme = self.groups[group][1]
        if isinstance(scheme, CompressedTensorsWNA16):
            return WNA16MoEMethod(WNA16ExpertFormat.compressed_tensors(scheme.symmetric), scheme.bits,
                                  scheme.group_size, f"config_groups.{group}.weights.group_size")
        if isinstance(scheme, CompressedTensorsW8A8Int8):
            return Int8MoEMethod(per_tensor=scheme.strategy == "tensor")
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
        group = self._common_group(names, f"the checkpoint modules {names}, which {prefix} fuses,")
        if group is None:
            return None
        current = getattr(layer, "quant_method", None)
        if isinstance(current, CompressedTensorsLinearMethod) and current.scheme is self.groups[group][1]:
            return current
        return CompressedTensorsLinearMethod(self.groups[group][1])
