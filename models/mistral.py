"""Mistral: the Llama layout with a sliding window on its attention layers.

config.json's `sliding_window` (null: none) applies to every layer, as transformers'
Mistral applies it, unless the config lists `layer_types` (then only the layers marked
sliding_attention; an unknown entry is a ValueError naming it). A window that covers
max_model_len masks nothing and is dropped (`LlamaModel`).
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from models.gemma2 import SLIDING, gemma_layer_types
from models.llama import LlamaForCausalLM, LlamaModel


def mistral_sliding_windows(hf_config: SimpleNamespace) -> list[int | None]:
    """Each layer's window: the config's `sliding_window` on the layers it applies to."""
    window = getattr(hf_config, "sliding_window", None)
    types = gemma_layer_types(hf_config, lambda i: SLIDING)
    return [window if layer_type == SLIDING else None for layer_type in types]


class MistralForCausalLM(LlamaForCausalLM):
    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        return LlamaModel(hf_config, self.qkv_bias, max_positions, sliding_windows=mistral_sliding_windows(hf_config))
