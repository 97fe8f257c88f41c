"""Qwen3: the Qwen2 layout with per-head RMSNorm on q and k (before RoPE), q/k/v and o
biases only with `attention_bias` (default off), a `head_dim` that may differ from
hidden_size / num_attention_heads, and optional sliding-window layers (`layer_types`).

Built by the model loader like Llama (models/llama.py), whose blocks it reuses; on each
rank the module holds that rank's shard. The q/k norm weights ([head_dim]) are
replicated: every rank normalises its own heads with the same weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from models.layers.attention import AttentionMetadata
from models.layers.layernorm import RMSNorm
from models.layers.rotary_embedding import RotaryEmbedding
from models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from models.qwen2 import qwen_sliding_windows


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, hf_config: SimpleNamespace, qkv_bias: bool, rotary_emb: RotaryEmbedding, sliding_window: int | None = None
    ) -> None:
        super().__init__(hf_config, qkv_bias, rotary_emb, sliding_window)
        self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        """This rank's partial sum of the attention output (the next norm all-reduces it)."""
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb.forward_after_qk_norm(positions, q, k, self.q_norm, self.k_norm, self.head_dim)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3's causal LM; tied embeddings when the config says so (small Qwen3 models)."""

    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        qkv_bias = bool(getattr(hf_config, "attention_bias", False))
        return LlamaModel(hf_config, qkv_bias, max_positions, Qwen3DecoderLayer, qwen_sliding_windows(hf_config))
