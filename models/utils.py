"""AutoWeightsLoader: routes checkpoint tensors to parameters by name.

Called by a model's `load_weights()` on every rank, with the stream of (name, tensor)
pairs from the model loader. It holds no tensor beyond the one being loaded. Fused
parameters are resolved with the model's `packed_modules_mapping` (checkpoint
sub-module -> (fused sub-module, shard id)); everything else is a direct name match.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from models.errors import WeightLoadError
from models.layers.weight_utils import default_weight_loader

_MAX_NAMES_IN_ERROR = 20


def format_names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    more = f" … and {len(names) - _MAX_NAMES_IN_ERROR} more" if len(names) > _MAX_NAMES_IN_ERROR else ""
    return f"[{shown}{more}]"


class AutoWeightsLoader:
    """Walks module names recursively; a child module with its own `load_weights`
    receives its sub-stream (names relative to it) and reports what it loaded.

    `load_weights` returns the set of parameter names (relative to `module`) that were
    filled. Checkpoint tensors that match no parameter are collected, and after the walk
    a `WeightLoadError` lists all of them together with the parameters still missing.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        skip_prefixes: list[str] | None = None,
        skip_substrs: list[str] | None = None,
    ) -> None:
        self.module = module
        self.skip_prefixes = skip_prefixes or []
        self.skip_substrs = skip_substrs or []
        self.packed_modules_mapping: dict[str, tuple[str, str | int]] = getattr(module, "packed_modules_mapping", {})
        self.unexpected: list[str] = []

    def _skip(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.skip_prefixes) or any(s in name for s in self.skip_substrs)

    def _map_packed(self, name: str) -> tuple[str, str | int | None]:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules_mapping:
                fused, shard_id = self.packed_modules_mapping[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self._load_module("", self.module, weights)
        if self.unexpected:
            params = {name for name, _ in self.module.named_parameters()}
            missing = params - loaded
            raise WeightLoadError(
                f"{len(self.unexpected)} checkpoint tensor(s) match no parameter of "
                f"{type(self.module).__name__}: {format_names(self.unexpected)}"
                + (f"; {len(missing)} parameter(s) were not loaded: {format_names(missing)}" if missing else "")
            )
        return loaded

    def _load_module(
        self, prefix: str, module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> set[str]:
        loaded: set[str] = set()
        # A fused parameter counts as loaded only once every one of its parts arrived.
        parts_seen: dict[str, set[str | int]] = {}
        params = dict(module.named_parameters(remove_duplicate=False))
        children = dict(module.named_modules(remove_duplicate=False))
        for ckpt_name, tensor in weights:
            full_name = prefix + ckpt_name
            if self._skip(full_name):
                continue
            child_name = ckpt_name.split(".", 1)[0]
            child = children.get(child_name) if "." in ckpt_name else None
            if child is not None and hasattr(child, "load_weights") and child is not module:
                # Delegation is per tensor: the child sees one (relative name, tensor) pair at a time.
                sub = child.load_weights([(ckpt_name.split(".", 1)[1], tensor)])
                loaded |= {f"{child_name}.{n}" for n in sub}
                continue
            param_name, shard_id = self._map_packed(ckpt_name)
            param = params.get(param_name)
            if param is None:
                self.unexpected.append(full_name)
                continue
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard_id is None:
                    weight_loader(param, tensor)
                else:
                    weight_loader(param, tensor, shard_id)
            except WeightLoadError as e:
                raise WeightLoadError(f"checkpoint tensor {full_name!r} -> parameter {param_name!r}: {e}") from None
            if shard_id is None:
                loaded.add(param_name)
                continue
            seen = parts_seen.setdefault(param_name, set())
            seen.add(shard_id)
            fused_module = param_name.rsplit(".", 2)[-2]
            if seen >= self._expected_parts(fused_module):
                loaded.add(param_name)
        return loaded

    def _expected_parts(self, fused_module: str) -> set[str | int]:
        return {shard for fused, shard in self.packed_modules_mapping.values() if fused == fused_module}
