"""Attention: causal attention over this rank's heads, with or without a paged KV cache.

A model calls `attn(q, k, v, attn_metadata)` and knows no kernel. Without metadata the
call is a full causal prefill of one sequence (the contract of
`model(input_ids, positions)`, and the profile run). With metadata the layer hands the
step to the `AttentionImpl` its backend gave it when the ModelRunner attached the KV
cache (`bind_kv_cache`). The layer holds no weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.layers.attention.masked_attention import causal_sdpa

if TYPE_CHECKING:
    from models.layers.attention.backends.abstract import AttentionImpl, AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer needs from the KV cache per token; the cache is sized from the
    layers' specs, so no other code computes heads per rank or the head size."""

    num_kv_heads: int  # on this rank
    head_size: int
    dtype: torch.dtype


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # A query at position p sees keys at positions > p - sliding_window (itself
        # included), as transformers' sliding-window mask; None: the whole context.
        self.sliding_window = sliding_window
        # Gemma 2: scores become soft_cap * tanh(scores / soft_cap) before the softmax.
        self.logits_soft_cap = logits_soft_cap
        # The model's dtype: the loader builds layers under it as the default dtype.
        self.dtype = torch.get_default_dtype()
        # Attached together by bind_kv_cache, once the cache is allocated.
        self.kv_cache: torch.Tensor | None = None
        self.impl: AttentionImpl | None = None

    def get_kv_cache_spec(self) -> AttentionSpec:
        """This layer's cache needs, in the dtype the model was built with."""
        return AttentionSpec(self.num_kv_heads, self.head_size, self.dtype)

    def bind_kv_cache(self, kv_cache: torch.Tensor, impl: AttentionImpl) -> None:
        self.kv_cache = kv_cache
        self.impl = impl

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata | None = None
    ) -> torch.Tensor:
        """q: [T, num_heads * head_size]; k, v: [T, num_kv_heads * head_size]. Returns [T, num_heads * head_size]."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if attn_metadata is None:
            out = causal_sdpa(q, k, v, self.scale, self.sliding_window, self.logits_soft_cap)
        else:
            if self.impl is None or self.kv_cache is None:
                raise RuntimeError("attention metadata was given but no KV cache is attached to this layer")
            out = self.impl.forward(q, k, v, self.kv_cache, attn_metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_size)
