"""The architecture registry: `config.json` "architectures" -> model class, imported lazily.

Only the module of the architecture actually used is imported, so adding architectures
costs nothing at start-up. Users may register their own with `ModelRegistry.register_model`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

from models.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class _LazyRegisteredModel:
    module_name: str
    class_name: str

    def load_model_cls(self) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module_name), self.class_name)


_TEXT_GENERATION_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("models.gemma3", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("models.mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("models.phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, _LazyRegisteredModel | type[nn.Module]] = {
            arch: _LazyRegisteredModel(mod, cls) for arch, (mod, cls) in _TEXT_GENERATION_MODELS.items()
        }

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def register_model(self, architecture: str, model_cls: type[nn.Module] | str) -> None:
        """Register a class, or a "module:Class" string that is imported on first use
        (the string form also works in worker processes that never ran this call)."""
        if isinstance(model_cls, str):
            module_name, _, class_name = model_cls.partition(":")
            self._models[architecture] = _LazyRegisteredModel(module_name, class_name)
        else:
            self._models[architecture] = model_cls

    def resolve_model_cls(self, architectures: list[str]) -> tuple[type[nn.Module], str]:
        """The first supported entry of `architectures` and its class; raises
        `UnsupportedArchitectureError` naming them and listing the supported ones."""
        for arch in architectures:
            entry = self._models.get(arch)
            if entry is None:
                continue
            cls = entry.load_model_cls() if isinstance(entry, _LazyRegisteredModel) else entry
            return cls, arch
        raise UnsupportedArchitectureError(
            f"model architecture(s) {architectures} are not supported; "
            f"supported architectures: {self.get_supported_archs()}"
        )


ModelRegistry = _ModelRegistry()
