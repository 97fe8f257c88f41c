"""Qwen2: the Llama layout with biases on q/k/v. Small Qwen2 checkpoints tie the LM head
to the embedding (`tie_word_embeddings`); like transformers, an absent key means untied.

Sliding windows, as transformers applies them (to Qwen2 and Qwen3 alike): only with `use_sliding_window: true`
(Qwen2.5 configs carry a `sliding_window` with it false, which then means nothing), on
the layers `layer_types` marks sliding_attention, or, without `layer_types`, on layers
i >= `max_window_layers` (default 28).
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from models.gemma2 import FULL, SLIDING, gemma_layer_types
from models.llama import LlamaForCausalLM, LlamaModel

_DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config default


def qwen_sliding_windows(hf_config: SimpleNamespace) -> list[int | None]:
    """Each layer's window (None: full attention). Raises ConfigError naming a bad
    `layer_types` entry."""
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", False) else None
    if window is None:
        return [None] * hf_config.num_hidden_layers
    first = getattr(hf_config, "max_window_layers", None)
    first = _DEFAULT_MAX_WINDOW_LAYERS if first is None else first
    types = gemma_layer_types(hf_config, lambda i: SLIDING if i >= first else FULL)
    return [window if layer_type == SLIDING else None for layer_type in types]


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True

    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        return LlamaModel(hf_config, self.qkv_bias, max_positions, sliding_windows=qwen_sliding_windows(hf_config))
