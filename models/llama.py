"""Llama (and the architectures that share its layout) with tensor parallelism.

Built by `model_loader.initialize_model()` as `LlamaForCausalLM(config)`: only
`config.model_config.hf_config` (the parsed config.json) and `max_model_len` are read;
quantisation and platform choices reach the layers through `LayerBuildConfig`. On each
rank the module holds that rank's shard.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from models.layers.activation import SiluAndMul
from models.layers.attention import Attention, AttentionMetadata
from models.layers.layernorm import RMSNorm
from models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from models.layers.rotary_embedding import RotaryEmbedding, get_rope
from models.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from models.utils import AutoWeightsLoader

if TYPE_CHECKING:
    from config import EngineConfig


def head_dim(hf_config: SimpleNamespace) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the MLP's output (the next norm all-reduces it)."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self, hf_config: SimpleNamespace, qkv_bias: bool, rotary_emb: RotaryEmbedding, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # transformers' Llama and Qwen3 give o_proj a bias with `attention_bias`.
        out_bias = getattr(hf_config, "attention_out_bias", getattr(hf_config, "attention_bias", False))
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, hidden_size, bias=out_bias,
            reduce_results=False,
        )
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, sliding_window)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        """This rank's partial sum of the attention output (the next norm all-reduces it)."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention  # a family's attention (Qwen3: q/k norms)

    def __init__(
        self, hf_config: SimpleNamespace, qkv_bias: bool, rotary_emb: RotaryEmbedding, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(hf_config, qkv_bias, rotary_emb, sliding_window)
        self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, getattr(hf_config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states` is this rank's partial sum of the previous layer's MLP output (of
        the embedding, in the first layer, where `residual` is None); returns this layer's
        partial MLP output and the residual. Each row-parallel output is summed over the
        ranks by the norm after it, which the CPU runs as one all-reduce + add + norm."""
        hidden_states, residual = self.input_layernorm(hidden_states, residual, all_reduce_input=True)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual, all_reduce_input=True)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        hf_config: SimpleNamespace,
        qkv_bias: bool,
        max_positions: int,
        decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
        sliding_windows: list[int | None] | None = None,
    ) -> None:
        """`sliding_windows`: per layer, the window or None (default: none). A window that
        covers max_positions (max_model_len) is dropped: it masks nothing, and without
        it backends that lack sliding-window support still run the model."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, reduce_results=False)
        # One cos/sin table for all layers, sized to the positions the engine can reach.
        rotary_emb = get_rope(hf_config, head_dim(hf_config), max_positions)
        windows = sliding_windows or [None] * hf_config.num_hidden_layers
        self.layers = nn.ModuleList(
            decoder_layer_cls(hf_config, qkv_bias, rotary_emb, w if w is not None and w < max_positions else None)
            for w in windows
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None = None
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual, all_reduce_input=True)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """The causal LM: `forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`,
    `compute_logits(hidden) -> [T, vocab_size]` on every rank, and
    `compute_greedy_tokens(hidden) -> [T]`, their argmax, without gathering them."""

    qkv_bias = False
    default_tie_word_embeddings = False
    # checkpoint sub-module name -> (fused parameter's sub-module, shard id)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = config.model_config.hf_config
        self.config = hf_config
        self.model = self.build_model(hf_config, config.model_config.max_model_len)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", self.default_tie_word_embeddings))
        self.lm_head = ParallelLMHead(
            hf_config.vocab_size,
            hf_config.hidden_size,
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
            # Gemma's final-logit soft cap; no other family's config carries the field.
            logits_soft_cap=getattr(hf_config, "final_logit_softcapping", None),
        )

    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        """The decoder stack (`.embed_tokens` and `forward(input_ids, positions,
        attn_metadata) -> hidden`); a family with another layer layout overrides it."""
        return LlamaModel(hf_config, self.qkv_bias, max_positions)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_greedy_tokens(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(
            self,
            skip_prefixes=["lm_head."] if self.tie_word_embeddings else None,
            skip_substrs=["rotary_emb.inv_freq"],
        )
        return loader.load_weights(weights)
