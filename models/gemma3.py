"""Gemma 3, text only (`gemma3_text`), with tensor parallelism: Gemma 2's layer (models/
gemma2.py) plus a per-head q/k norm (Gemma's 1 + w) before the rotary embedding, and two
RoPE tables: sliding layers use `rope_local_base_freq` unscaled, global layers
`rope_theta` with `rope_scaling`. Layer i is global when (i + 1) % sliding_window_pattern
== 0 (default 6), unless the config lists `layer_types`. transformers v5 writes both
RoPE settings as `rope_parameters[layer_type]`; both spellings are read. No attention or
logit soft cap by default; set in the config, both are honoured, as vLLM does (note:
transformers' Gemma 3 applies `final_logit_softcapping` but reads and then ignores
`attn_logit_softcapping`; no released checkpoint sets either).

Built by `model_loader.initialize_model()` as `Gemma3ForCausalLM(config)`, on every rank
alike; raises ConfigError naming a config field whose value we do not implement.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

from config.utils import ConfigError
from models.gemma2 import FULL, SLIDING, Gemma2Attention, Gemma2ForCausalLM, Gemma2Model, gemma_layer_types
from models.layers.layernorm import GemmaRMSNorm
from models.layers.rotary_embedding import RotaryEmbedding, rope_settings
from models.llama import LlamaAttention, head_dim
from models.qwen3 import Qwen3Attention

_DEFAULT_SLIDING_WINDOW_PATTERN = 6
_DEFAULT_LOCAL_ROPE_THETA = 10000.0


def gemma3_rope_settings(hf_config: SimpleNamespace, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of the layers of `layer_type`."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):  # transformers v5
        per_type = params[layer_type]
        theta = per_type.get("rope_theta", _DEFAULT_LOCAL_ROPE_THETA)
        return float(theta), per_type if per_type.get("rope_type", "default") != "default" else None
    if layer_type == SLIDING:
        return float(getattr(hf_config, "rope_local_base_freq", None) or _DEFAULT_LOCAL_ROPE_THETA), None
    return rope_settings(hf_config)


def _default_layer_type(hf_config: SimpleNamespace) -> Callable[[int], str]:
    """Transformers' Gemma3TextConfig default: every `sliding_window_pattern`-th layer is global."""
    pattern = (getattr(hf_config, "sliding_window_pattern", None) or getattr(hf_config, "_sliding_window_pattern", None)
               or _DEFAULT_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"sliding_window_pattern={pattern!r} must be a positive integer")
    return lambda i: FULL if (i + 1) % pattern == 0 else SLIDING


class Gemma3Attention(Gemma2Attention):
    """Gemma2Attention with q/k RMSNorm over each head (weights [head_dim], shared by
    the heads, so every rank holds all of them)."""

    def __init__(self, hf_config: SimpleNamespace, rotary_emb: RotaryEmbedding, layer_type: str,
                 max_positions: int) -> None:
        super().__init__(hf_config, rotary_emb, layer_type, max_positions)
        self.q_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps)

    # Qwen3's q/k-norm forward, which reads only the attributes both classes define.
    forward = Qwen3Attention.forward


class Gemma3Model(Gemma2Model):
    def make_attentions(self, hf_config: SimpleNamespace, max_positions: int) -> list[LlamaAttention]:
        """One attention module per layer; the layers of a type share one RoPE table."""
        types = gemma_layer_types(hf_config, _default_layer_type(hf_config))
        rotary = {t: RotaryEmbedding(head_dim(hf_config), max_positions, *gemma3_rope_settings(hf_config, t))
                  for t in dict.fromkeys(types)}
        return [Gemma3Attention(hf_config, rotary[t], t, max_positions) for t in types]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
