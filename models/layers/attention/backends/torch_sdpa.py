"""TorchSDPABackend: paged attention with torch's scaled_dot_product_attention.

The portable backend (CUDA uses it until a flash-attention backend plugs in beside it;
the CPU backend extends it). Each layer writes the step's K/V into its paged cache, then
attends: decode tokens (one query per sequence) in a few batched calls over padded,
masked contexts gathered from the cache; longer chunks one call each, a whole prompt
against itself with no gather at all.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from distributed.utils import cdiv
from models.layers.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    gather_paged_kv,
)
from models.layers.attention.layer import Attention, causal_sdpa

# Decode sequences are attended in groups whose padded K/V context (gathered from the
# paged cache) stays under this many bytes; see TorchSDPAImpl.decode_attention.
DECODE_GROUP_BYTES = 8 << 20
# A chunk over cached context runs SDPA with a mask, which takes the math kernel: its
# float32 scores, probabilities and mask are [H, queries, context]. The queries are split
# so that those stay under this many bytes (2k queries at 32k context and 32 heads
# would otherwise need about 8 GiB, which no profile run sees).
CHUNK_SCORES_BYTES = 256 << 20


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended in one SDPA call, with their gather indices and mask."""

    rows: torch.Tensor | None  # positions in the decode batch; None = all of it, in order
    blocks: torch.Tensor  # [G * num_blocks] cache block ids to gather (padding clamped to 0)
    mask: torch.Tensor  # [1, G, 1, ctx_len]: True where a key is real context
    ctx_len: int


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    """The common metadata plus the decode grouping, built by the first layer that
    needs it and shared by the others (they share `bytes_per_token`)."""

    @classmethod
    def from_common(cls, common: AttentionMetadata, **extra: object) -> TorchSDPAMetadata:
        return cls(**{f.name: getattr(common, f.name) for f in fields(AttentionMetadata)}, **extra)

    def decode_groups(self, bytes_per_token: int, device: torch.device) -> list[DecodeGroup]:
        cache: dict[int, list[DecodeGroup]] = self.__dict__.setdefault("_decode_groups", {})
        if bytes_per_token not in cache:
            cache[bytes_per_token] = self._build_decode_groups(bytes_per_token, device)
        return cache[bytes_per_token]

    def _build_decode_groups(self, bytes_per_token: int, device: torch.device) -> list[DecodeGroup]:
        seqs, block_size = self.decode_seqs, self.block_size
        order = sorted(range(len(seqs)), key=lambda t: self.seq_lens[seqs[t]])
        members: list[list[int]] = [[]]
        for t in order:
            padded_len = cdiv(self.seq_lens[seqs[t]], block_size) * block_size
            if members[-1] and (len(members[-1]) + 1) * padded_len * bytes_per_token > DECODE_GROUP_BYTES:
                members.append([])
            members[-1].append(t)
        identity = len(members) == 1 and order == list(range(len(seqs)))
        groups = []
        for member in members:
            group_seqs = [seqs[t] for t in member]
            seq_lens = torch.tensor([self.seq_lens[i] for i in group_seqs], dtype=torch.long, device=device)
            num_blocks = cdiv(max(self.seq_lens[i] for i in group_seqs), block_size)
            ctx_len = num_blocks * block_size
            table_rows = torch.tensor(group_seqs, dtype=torch.long, device=self.block_tables.device)
            # Table padding is masked out below; clamp it so any fill value is a valid index.
            blocks = self.block_tables[table_rows, :num_blocks].clamp(min=0).reshape(-1).to(device)
            mask = (torch.arange(ctx_len, device=device) < seq_lens.unsqueeze(1)).view(1, len(member), 1, ctx_len)
            rows = None if identity else torch.tensor(member, dtype=torch.long, device=device)
            groups.append(DecodeGroup(rows, blocks, mask, ctx_len))
        return groups


class TorchSDPAImpl(AttentionImpl):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """Decode sequences (one query token) are batched: a few SDPA calls over padded,
        masked contexts instead of one tiny call per sequence. Longer chunks (prefill)
        are large enough to run one call each."""
        assert isinstance(md, TorchSDPAMetadata)
        self.write_kv(k, v, kv_cache, md)
        qsl = md.query_start_loc
        num_seqs = len(md.seq_lens)
        decodes = md.decode_seqs
        if len(decodes) == num_seqs:  # pure decode: token i belongs to sequence i
            return self.decode_attention(q, k, v, kv_cache, md)
        out = torch.empty_like(q)
        if decodes:
            rows = torch.tensor([qsl[i] for i in decodes], dtype=torch.long, device=q.device)
            out[rows] = self.decode_attention(q[rows], k[rows], v[rows], kv_cache, md)
        for i in range(num_seqs):
            start, end = qsl[i], qsl[i + 1]
            if end - start > 1:
                out[start:end] = self._chunk_attention(q[start:end], k[start:end], v[start:end], kv_cache, md, i)
        return out

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> None:
        """The step's new keys and values into their slots of the paged cache."""
        block_ids, offsets = md.slot_blocks_and_offsets
        kv_cache[block_ids, 0, offsets] = k.to(kv_cache.dtype)
        kv_cache[block_ids, 1, offsets] = v.to(kv_cache.dtype)

    def _chunk_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
        i: int,
    ) -> torch.Tensor:
        """Sequence i's query chunk q [n, H, D] (new keys and values k, v) against its
        whole cached context."""
        seq_len, query_len = md.seq_lens[i], q.shape[0]
        if seq_len == query_len and kv_cache.dtype == q.dtype:  # a whole prompt: the chunk is the context
            return causal_sdpa(q, k, v, self.scale)
        num_blocks = cdiv(seq_len, md.block_size)
        ctx = gather_paged_kv(kv_cache, md.block_tables[i, :num_blocks], 1, num_blocks * md.block_size)
        keys = ctx[0, :, 0, :seq_len].unsqueeze(0).to(q.dtype)
        values = ctx[1, :, 0, :seq_len].unsqueeze(0).to(q.dtype)
        rows = max(1, CHUNK_SCORES_BYTES // self.scores_bytes_per_query(seq_len))
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        out = torch.empty_like(q)
        for lo in range(0, query_len, rows):
            hi = min(lo + rows, query_len)
            # Query j sits at position seq_len - query_len + j and sees keys up to it.
            q_pos = torch.arange(seq_len - query_len + lo, seq_len - query_len + hi, device=q.device).unsqueeze(1)
            out[lo:hi] = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1).unsqueeze(0), keys, values,
                attn_mask=k_pos <= q_pos,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            ).squeeze(0).transpose(0, 1)
        return out

    def scores_bytes_per_query(self, context_len: int) -> int:
        """What the masked (math) SDPA holds per query row: float32 scores and
        probabilities, and the boolean mask, over `context_len` keys and every head."""
        return self.num_heads * context_len * (4 + 4 + 1)

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: TorchSDPAMetadata
    ) -> torch.Tensor:
        """q [len(md.decode_seqs), H, D]: the one (last) query token of each decode
        sequence; k, v its new key and value (already in the paged cache).

        Sequences are sorted by length and split into groups whose padded context stays
        under DECODE_GROUP_BYTES: one big padded gather costs more than it saves (page
        faults, padding), many tiny calls cost per-call overhead. The grouping and its
        index tensors depend only on the step, so every layer reuses the first one's.
        """
        bytes_per_token = 2 * self.num_kv_heads * self.head_size * kv_cache.element_size()
        groups = md.decode_groups(bytes_per_token, kv_cache.device)
        if len(groups) == 1 and groups[0].rows is None:
            return self._decode_group(q, kv_cache, groups[0])
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = self._decode_group(q[group.rows], kv_cache, group)
        return out

    def _decode_group(self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """One SDPA call for the single query token of each sequence in `group` (q [G, H, D])."""
        ctx = gather_paged_kv(kv_cache, group.blocks, q.shape[0], group.ctx_len)
        return self.attend_padded(q, ctx[0], ctx[1], group.mask)

    def attend_padded(
        self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [G, H, D], one query per sequence; k_ctx, v_ctx [Hkv, G, ctx_len, D] padded
        contexts; mask [1, G, 1, ctx_len] (bool: True = attend, or additive)."""
        num_seqs, num_kv_heads, head_size = q.shape[0], self.num_kv_heads, self.head_size
        # Query heads sharing a kv head become that head's query rows: q [Hkv, G, H/Hkv, D].
        heads_per_kv = self.num_heads // num_kv_heads
        q = q.view(num_seqs, num_kv_heads, heads_per_kv, head_size).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), attn_mask=mask, scale=self.scale
        )
        return out.transpose(0, 1).reshape(num_seqs, self.num_heads, head_size)


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"

    def workspace_bytes(self, layer: Attention, max_model_len: int) -> int:
        """A chunk over a cached context of max_model_len: the context gathered out of
        the cache (and cast), plus the bounded scores (CHUNK_SCORES_BYTES)."""
        gathered = 2 * layer.num_kv_heads * max_model_len * layer.head_size * layer.dtype.itemsize * 2
        return gathered + CHUNK_SCORES_BYTES

    def make_impl(self, layer: Attention) -> AttentionImpl:
        return TorchSDPAImpl(layer)

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        return TorchSDPAMetadata.from_common(common)
