"""Phi-3 / Phi-4-mini: the Llama layout, with the checkpoint's fused projections,
partial rotary (`partial_rotary_factor`: Phi-4-mini rotates 3/4 of each head), LongRoPE
scaling (models/layers/rotary_embedding.py) and a sliding window on every layer.

The checkpoint stores `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up] rows)
whole. `load_weights` slices each into its parts (views, no copy) and hands them to the
fused layers' weight loaders with their shard ids, exactly as separate q/k/v and
gate/up tensors would be: every rank then keeps its own heads and its own slice of the
intermediate dimension, whatever the TP size.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterable, Iterator

import torch
from torch import nn

from models.errors import WeightLoadError
from models.llama import LlamaForCausalLM, LlamaModel, head_dim


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3's causal LM. Untied unless the config says `tie_word_embeddings` (Phi-4-mini)."""

    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        # transformers' Phi3 applies `sliding_window` (when set) to every layer.
        window = getattr(hf_config, "sliding_window", None)
        return LlamaModel(hf_config, self.qkv_bias, max_positions,
                          sliding_windows=[window] * hf_config.num_hidden_layers)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint stream with each fused tensor (weight or bias) replaced by its
        parts under the unfused names (`packed_modules_mapping` maps them back)."""
        cfg = self.config
        q_size = cfg.num_attention_heads * head_dim(cfg)
        kv_size = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim(cfg)
        fused = {
            "qkv_proj": (("q_proj", "k_proj", "v_proj"), [q_size, kv_size, kv_size]),
            "gate_up_proj": (("gate_proj", "up_proj"), [cfg.intermediate_size] * 2),
        }
        for name, tensor in weights:
            prefix, module, suffix = name.rsplit(".", 2) if name.count(".") >= 2 else ("", name, "")
            if module not in fused:
                yield name, tensor
                continue
            parts, sizes = fused[module]
            if tensor.dim() == 0 or tensor.shape[0] != sum(sizes):
                raise WeightLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; the config "
                                      f"makes {module} {sum(sizes)} rows ({' + '.join(map(str, sizes))})")
            for part, t in zip(parts, tensor.split(sizes, dim=0)):
                yield f"{prefix}.{part}.{suffix}", t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Called on every rank by the model loader; holds no tensor beyond the one being
        loaded. Raises WeightLoadError naming a fused tensor whose rows do not match the
        config (and, through the layers' loaders, a part of the wrong shape)."""
        return super().load_weights(self._split_fused(weights))
