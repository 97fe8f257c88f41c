"""Causal attention over this rank's heads, with or without a paged KV cache.

Without metadata the call is a full causal prefill of one sequence (the contract of
`model(input_ids, positions)`). With `AttentionMetadata` the layer first writes the new
keys and values into its paged cache, then attends each sequence's queries to its
whole cached context. Both paths use `scaled_dot_product_attention`; a faster CUDA
kernel can replace `_paged_attention` behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Built once per step by the ModelRunner and shared by every layer.

    Tokens of all scheduled sequences are flattened into one batch; sequence i owns
    tokens [query_start_loc[i], query_start_loc[i+1]) and, after this step, has
    seq_lens[i] tokens of context in the blocks listed in block_tables[i].
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seq_lens: list[int]
    query_start_loc: list[int]  # num_seqs + 1 entries
    block_size: int


class Attention(nn.Module):
    """Holds no weights. `kv_cache` ([num_blocks, 2, block_size, num_kv_heads, head_size])
    is attached by the worker once the cache is allocated."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata | None = None
    ) -> torch.Tensor:
        """q: [T, num_heads * head_size]; k, v: [T, num_kv_heads * head_size]. Returns [T, num_heads * head_size]."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        if attn_metadata is None:
            out = self._sdpa(q, k, v, mask=None)
        else:
            out = self._paged_attention(q, k, v, attn_metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # [T, H, D] -> [1, H, T, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)

    def _paged_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("attention metadata was given but no KV cache is attached to this layer")
        cache = self.kv_cache
        block_ids = md.slot_mapping // md.block_size
        offsets = md.slot_mapping % md.block_size
        cache[block_ids, 0, offsets] = k.to(cache.dtype)
        cache[block_ids, 1, offsets] = v.to(cache.dtype)
        outputs = []
        for i, seq_len in enumerate(md.seq_lens):
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            query_len = end - start
            num_blocks = -(-seq_len // md.block_size)
            blocks = md.block_tables[i, :num_blocks]
            k_ctx = cache[blocks, 0].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len].to(q.dtype)
            v_ctx = cache[blocks, 1].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len].to(q.dtype)
            # Query j sits at position seq_len - query_len + j and sees keys up to it.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            outputs.append(self._sdpa(q[start:end], k_ctx, v_ctx, mask=mask))
        return torch.cat(outputs, dim=0)
