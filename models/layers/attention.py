"""Causal attention over this rank's heads, with or without a paged KV cache.

Without metadata the call is a full causal prefill of one sequence (the contract of
`model(input_ids, positions)`). With `AttentionMetadata` the layer first writes the new
keys and values into its paged cache, then attends each sequence's queries to its
whole cached context: decode tokens (one query per sequence) in a few batched calls over
padded, masked contexts, longer chunks one call each. Both paths use
`scaled_dot_product_attention`; a faster CUDA kernel can replace `_paged_attention`
behind the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Decode sequences are attended in groups whose padded K/V context (gathered from the
# paged cache) stays under this many bytes; see Attention._decode_attention.
DECODE_GROUP_BYTES = 8 << 20


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
        """Write this step's K/V into the paged cache, then attend every query to its
        sequence's cached context (causally within the chunk).

        Decode sequences (one query token) are batched: a few SDPA calls over padded,
        masked contexts instead of one tiny call per sequence. Longer chunks (prefill)
        are large enough to run one call each.
        """
        if self.kv_cache is None:
            raise RuntimeError("attention metadata was given but no KV cache is attached to this layer")
        cache = self.kv_cache
        block_ids = md.slot_mapping // md.block_size
        offsets = md.slot_mapping % md.block_size
        cache[block_ids, 0, offsets] = k.to(cache.dtype)
        cache[block_ids, 1, offsets] = v.to(cache.dtype)
        qsl = md.query_start_loc
        num_seqs = len(md.seq_lens)
        decodes = [i for i in range(num_seqs) if qsl[i + 1] - qsl[i] == 1]
        if len(decodes) == num_seqs:  # pure decode: token i belongs to sequence i
            return self._decode_attention(q, md, decodes)
        out = torch.empty_like(q)
        if decodes:
            rows = torch.tensor([qsl[i] for i in decodes], dtype=torch.long, device=q.device)
            out[rows] = self._decode_attention(q[rows], md, decodes)
        for i in range(num_seqs):
            start, end = qsl[i], qsl[i + 1]
            if end - start > 1:
                out[start:end] = self._chunk_attention(q[start:end], md, i)
        return out

    def _chunk_attention(self, q: torch.Tensor, md: AttentionMetadata, i: int) -> torch.Tensor:
        """Sequence i's query chunk q [n, H, D] against its whole cached context."""
        seq_len, query_len = md.seq_lens[i], q.shape[0]
        cache = self.kv_cache
        assert cache is not None
        num_blocks = -(-seq_len // md.block_size)
        blocks = md.block_tables[i, :num_blocks]
        k_ctx = cache[blocks, 0].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len].to(q.dtype)
        v_ctx = cache[blocks, 1].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len].to(q.dtype)
        # Query j sits at position seq_len - query_len + j and sees keys up to it.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        return self._sdpa(q, k_ctx, v_ctx, mask=k_pos <= q_pos)

    def _decode_attention(self, q: torch.Tensor, md: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
        """q [len(seqs), H, D]: the one (last) query token of each sequence in `seqs`.

        Sequences are sorted by length and split into groups whose padded context stays
        under DECODE_GROUP_BYTES: one big padded gather costs more than it saves (page
        faults, padding), many tiny calls cost per-call overhead.
        """
        cache = self.kv_cache
        assert cache is not None
        block_size = md.block_size
        bytes_per_token = 2 * self.num_kv_heads * self.head_size * cache.element_size()
        order = sorted(range(len(seqs)), key=lambda t: md.seq_lens[seqs[t]])
        groups: list[list[int]] = [[]]
        for t in order:
            padded_len = -(-md.seq_lens[seqs[t]] // block_size) * block_size
            if groups[-1] and (len(groups[-1]) + 1) * padded_len * bytes_per_token > DECODE_GROUP_BYTES:
                groups.append([])
            groups[-1].append(t)
        if len(groups) == 1 and order == list(range(len(seqs))):
            return self._decode_group(q, md, seqs)
        out = torch.empty_like(q)
        for group in groups:
            rows = torch.tensor(group, dtype=torch.long, device=q.device)
            out[rows] = self._decode_group(q[rows], md, [seqs[t] for t in group])
        return out

    def _decode_group(self, q: torch.Tensor, md: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
        """One SDPA call for the single query token of each of `seqs` (q [G, H, D])."""
        cache = self.kv_cache
        assert cache is not None
        num_seqs, block_size, num_kv_heads, head_size = len(seqs), md.block_size, self.num_kv_heads, self.head_size
        seq_lens = torch.tensor([md.seq_lens[i] for i in seqs], dtype=torch.long, device=q.device)
        num_blocks = -(-max(md.seq_lens[i] for i in seqs) // block_size)
        ctx_len = num_blocks * block_size
        rows = torch.tensor(seqs, dtype=torch.long, device=md.block_tables.device)
        # Table padding is masked out below; clamp it so any fill value is a valid index.
        blocks = md.block_tables[rows, :num_blocks].clamp(min=0).reshape(-1).to(cache.device)
        # cache [N, 2, bs, Hkv, D] viewed as [2, Hkv, N, bs, D]; index_select writes a
        # contiguous [2, Hkv, G * nb, bs, D], i.e. [2, Hkv, G, ctx_len, D] per head.
        ctx = cache.permute(1, 3, 0, 2, 4).index_select(2, blocks)
        ctx = ctx.view(2, num_kv_heads, num_seqs, ctx_len, head_size).to(q.dtype)
        # Query heads sharing a kv head become that head's query rows: q [Hkv, G, H/Hkv, D].
        group = self.num_heads // num_kv_heads
        q = q.view(num_seqs, num_kv_heads, group, head_size).transpose(0, 1)
        mask = (torch.arange(ctx_len, device=q.device) < seq_lens.unsqueeze(1)).view(1, num_seqs, 1, ctx_len)
        out = F.scaled_dot_product_attention(q, ctx[0], ctx[1], attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1).reshape(num_seqs, self.num_heads, head_size)
