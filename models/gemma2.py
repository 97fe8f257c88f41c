"""Gemma 2 with tensor parallelism, built from the Llama blocks.

Built by `model_loader.initialize_model()` as `Gemma2ForCausalLM(config)`, on every rank
alike; reads only `config.model_config.hf_config` and `max_model_len`. What differs
from Llama, each as transformers' Gemma2 computes it:
- each layer norms four times: before and after attention, before and after the MLP,
  and every norm is Gemma's `rms_norm(x) * (1 + w)` (`GemmaRMSNorm`);
- embeddings are scaled by sqrt(hidden_size), rounded to the model dtype first;
- attention scale `query_pre_attn_scalar ** -0.5`, scores soft-capped by
  `attn_logit_softcapping`, and logits by `final_logit_softcapping` (the LM head);
- layers alternate sliding-window (even indices) and global attention, unless the
  config lists `layer_types`;
- the MLP is a GeGLU with the config's `hidden_activation` (tanh-approximate GELU).
A field with a value we do not implement is refused with a ConfigError naming it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from config.utils import ConfigError

from models.layers.activation import get_act_and_mul_fn
from models.layers.attention import Attention, AttentionMetadata
from models.layers.layernorm import GemmaRMSNorm
from models.layers.rotary_embedding import RotaryEmbedding, get_rope
from models.layers.vocab_parallel_embedding import VocabParallelEmbedding
from models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma_layer_types(hf_config: SimpleNamespace, default: Callable[[int], str]) -> list[str]:
    """Each layer's attention type: config.json's `layer_types` when present (newer
    transformers writes it), else `default(layer_index)`. Raises ConfigError naming a
    `layer_types` entry that is neither sliding_attention nor full_attention, or a list
    whose length is not num_hidden_layers."""
    num_layers = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return [default(i) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"layer_types={types!r} must list one type for each of the {num_layers} layers")
    for i, layer_type in enumerate(types):
        if layer_type not in (SLIDING, FULL):
            raise ConfigError(f"layer_types[{i}]={layer_type!r} is not supported; supported: {[SLIDING, FULL]}")
    return list(types)


def _optional_positive(hf_config: SimpleNamespace, field: str) -> float | None:
    value = getattr(hf_config, field, None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ConfigError(f"{field}={value!r} must be a positive number or null")
    return value


class Gemma2Attention(LlamaAttention):
    """LlamaAttention with Gemma's scale, soft cap and (for sliding layers) window. A
    window that covers max_positions (max_model_len) masks nothing and is dropped, as
    LlamaModel drops it. `attention_bias` gives q, k, v and o biases, as transformers."""

    def __init__(self, hf_config: SimpleNamespace, rotary_emb: RotaryEmbedding, layer_type: str,
                 max_positions: int) -> None:
        super().__init__(hf_config, bool(getattr(hf_config, "attention_bias", False)), rotary_emb)
        scalar = getattr(hf_config, "query_pre_attn_scalar", None) or head_dim(hf_config)
        window = getattr(hf_config, "sliding_window", None) if layer_type == SLIDING else None
        window = window if window is not None and window < max_positions else None
        # Attention holds no weights: replacing Llama's plain one costs nothing.
        self.attn = Attention(self.num_heads, self.head_dim, scalar**-0.5, self.num_kv_heads, sliding_window=window,
                              logits_soft_cap=_optional_positive(hf_config, "attn_logit_softcapping"))


class GemmaMLP(LlamaMLP):
    """LlamaMLP with the config's `hidden_activation` (transformers reads that field,
    not `hidden_act`, for Gemma 2 and 3)."""

    def __init__(self, hf_config: SimpleNamespace) -> None:
        super().__init__(hf_config.hidden_size, hf_config.intermediate_size)
        activation = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.act_fn = get_act_and_mul_fn("hidden_activation", activation)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, hf_config: SimpleNamespace, self_attn: LlamaAttention) -> None:
        super().__init__()
        size, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = GemmaMLP(hf_config)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In the first layer (`residual` None) `hidden_states` is this rank's partial
        sum of the scaled embedding; later it is the previous layer's normed MLP output,
        already summed over the ranks. Returns (this layer's normed MLP output, the
        residual). The attention and MLP return partial sums; the post-norms sum them
        over the ranks (a collective: every rank calls this alike)."""
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states, all_reduce_input=True)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, _ = self.post_attention_layernorm(hidden_states, all_reduce_input=True)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        hidden_states, _ = self.post_feedforward_layernorm(hidden_states, all_reduce_input=True)
        return hidden_states, residual


class Gemma2Model(nn.Module):
    """The Gemma decoder stack; Gemma 3's subclasses `make_attentions`."""

    def __init__(self, hf_config: SimpleNamespace, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, reduce_results=False)
        # transformers multiplies by sqrt(hidden) rounded to the model dtype (the default
        # dtype while the loader builds us); as a Python float the product rounds the same.
        self.normalizer = float(torch.tensor(hf_config.hidden_size**0.5, dtype=torch.get_default_dtype()))
        self.layers = nn.ModuleList(Gemma2DecoderLayer(hf_config, attn)
                                    for attn in self.make_attentions(hf_config, max_positions))
        self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def make_attentions(self, hf_config: SimpleNamespace, max_positions: int) -> list[LlamaAttention]:
        """One attention module per layer; Gemma 2's layer i is windowed when i is even."""
        types = gemma_layer_types(hf_config, lambda i: SLIDING if i % 2 == 0 else FULL)
        rotary_emb = get_rope(hf_config, head_dim(hf_config), max_positions)
        return [Gemma2Attention(hf_config, rotary_emb, layer_type, max_positions) for layer_type in types]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None = None
    ) -> torch.Tensor:
        # The lookup is this rank's partial sum; scaling it first is exact (the other
        # ranks' rows are zeros) and the first norm sums it.
        hidden_states = self.embed_tokens(input_ids).mul_(self.normalizer)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface and weight names; the LM head is tied by default and
    soft-caps the logits by `final_logit_softcapping` (see LlamaForCausalLM)."""

    default_tie_word_embeddings = True
    model_cls: type[Gemma2Model] = Gemma2Model

    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        _optional_positive(hf_config, "final_logit_softcapping")
        return self.model_cls(hf_config, max_positions)
