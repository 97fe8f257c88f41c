"""TorchSDPABackend: paged attention with torch's scaled_dot_product_attention.

The portable backend (CUDA uses it until a flash-attention backend plugs in beside it;
the CPU backend extends it). Each layer writes the step's K/V into its paged cache, then
attends: decode tokens (one query per sequence) in a few batched calls over padded,
masked contexts gathered from the cache; longer chunks one call each, a whole prompt
against itself with no gather at all. A layer with a sliding window or a logit soft cap
attends with explicit masks (`masked_attention`): decode groups and chunks read only
the blocks their window reaches and mask the keys below it, and a soft
cap computes the scores in float32 where SDPA would hide them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from distributed.utils import cdiv
from models.layers.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    gather_paged_kv,
)
from models.layers.attention.masked_attention import CHUNK_SCORES_BYTES, capped_attention, causal_attention, causal_sdpa

# Decode sequences are attended in groups whose padded K/V context (gathered from the
# paged cache) stays under this many bytes; see TorchSDPAImpl.decode_attention.
DECODE_GROUP_BYTES = 8 << 20
# A chunk over cached context runs SDPA with a mask, which takes the math kernel: its
# float32 scores, probabilities and mask are [H, queries, context], split by query rows
# to stay under CHUNK_SCORES_BYTES (masked_attention.py).


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended in one SDPA call, with their gather indices and mask."""

    rows: torch.Tensor | None  # positions in the decode batch; None = all of it, in order
    blocks: torch.Tensor  # [G * num_blocks] cache block ids to gather (padding clamped to 0)
    mask: torch.Tensor  # [1, G, 1, ctx_len]: True where a key is real context (in the window)
    # Row g's context starts at its first block in its window (0 without one), so column j
    # of the mask is position first_block[g] * block_size + j.
    ctx_len: int


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    """The common metadata plus the decode grouping, built by the first layer that
    needs it and shared by the others (they share `bytes_per_token`)."""

    @classmethod
    def from_common(cls, common: AttentionMetadata, **extra: object) -> TorchSDPAMetadata:
        return cls(**{f.name: getattr(common, f.name) for f in fields(AttentionMetadata)}, **extra)

    def decode_groups(self, bytes_per_token: int, device: torch.device,
                      sliding_window: int | None = None) -> list[DecodeGroup]:
        """The decode sequences in groups, with masks that also hide each sequence's keys
        below its window (a layer's `sliding_window`; None: the whole context). One
        grouping per (bytes_per_token, window), shared by the layers that ask for it."""
        if sliding_window is not None and sliding_window >= max(self.seq_lens[i] for i in self.decode_seqs):
            sliding_window = None  # no context reaches past the window: the same groups
        cache: dict[tuple[int, int | None], list[DecodeGroup]] = self.__dict__.setdefault("_decode_groups", {})
        if (bytes_per_token, sliding_window) not in cache:
            cache[bytes_per_token, sliding_window] = self._build_decode_groups(bytes_per_token, device, sliding_window)
        return cache[bytes_per_token, sliding_window]

    def _build_decode_groups(self, bytes_per_token: int, device: torch.device,
                             sliding_window: int | None) -> list[DecodeGroup]:
        """Groups of decode sequences by the length of context they read: all of it, or
        with a window only the blocks from the one holding the window's first key (a
        sequence 5 windows long gathers about one window, not five)."""
        seqs, block_size = self.decode_seqs, self.block_size
        first_block = [0 if sliding_window is None else max(0, self.seq_lens[i] - sliding_window) // block_size
                       for i in seqs]
        spans = [cdiv(self.seq_lens[i], block_size) - first for i, first in zip(seqs, first_block)]
        order = sorted(range(len(seqs)), key=lambda t: spans[t])
        members: list[list[int]] = [[]]
        for t in order:
            if members[-1] and (len(members[-1]) + 1) * spans[t] * block_size * bytes_per_token > DECODE_GROUP_BYTES:
                members.append([])
            members[-1].append(t)
        identity = len(members) == 1 and order == list(range(len(seqs)))
        table_device, table_width = self.block_tables.device, self.block_tables.shape[1]
        groups = []
        for member in members:
            num_blocks = max(spans[t] for t in member)
            ctx_len = num_blocks * block_size
            firsts = torch.tensor([first_block[t] for t in member], dtype=torch.long, device=table_device)
            table_rows = torch.tensor([seqs[t] for t in member], dtype=torch.long, device=table_device)
            cols = (firsts.unsqueeze(1) + torch.arange(num_blocks, device=table_device)).clamp(max=table_width - 1)
            # Table padding and columns past a shorter sequence's end are masked out below;
            # clamp them so any fill value is a valid index.
            blocks = self.block_tables[table_rows.unsqueeze(1), cols].clamp(min=0).reshape(-1).to(device)
            seq_lens = torch.tensor([self.seq_lens[seqs[t]] for t in member], dtype=torch.long, device=device)
            # Key j of row g sits at position firsts[g] * block_size + j.
            positions = firsts.to(device).unsqueeze(1) * block_size + torch.arange(ctx_len, device=device)
            mask = positions < seq_lens.unsqueeze(1)
            if sliding_window is not None:  # the query sits at seq_len - 1
                mask &= positions >= (seq_lens - sliding_window).unsqueeze(1)
            mask = mask.view(1, len(member), 1, ctx_len)
            rows = None if identity else torch.tensor(member, dtype=torch.long, device=device)
            groups.append(DecodeGroup(rows, blocks, mask, ctx_len))
        return groups


class TorchSDPAImpl(AttentionImpl):
    def __init__(self, layer: AttentionLayer) -> None:
        super().__init__(layer)
        self.logits_soft_cap = layer.logits_soft_cap

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
        cached context: with a window, only the blocks from the first one the chunk's
        first query sees."""
        seq_len, query_len = md.seq_lens[i], q.shape[0]
        window, soft_cap = self.sliding_window, self.logits_soft_cap
        if seq_len == query_len and kv_cache.dtype == q.dtype:  # a whole prompt: the chunk is the context
            return causal_sdpa(q, k, v, self.scale, window, soft_cap)
        q_start = seq_len - query_len  # query j sits at position q_start + j
        first_block = 0 if window is None else max(0, q_start - window + 1) // md.block_size
        num_blocks = cdiv(seq_len, md.block_size)
        k_start = first_block * md.block_size
        ctx = gather_paged_kv(kv_cache, md.block_tables[i, first_block:num_blocks], 1,
                              (num_blocks - first_block) * md.block_size)
        keys = ctx[0, :, 0, :seq_len - k_start].to(q.dtype)
        values = ctx[1, :, 0, :seq_len - k_start].to(q.dtype)
        return causal_attention(q, keys, values, self.scale, q_start, k_start, window, soft_cap)

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
        groups = md.decode_groups(bytes_per_token, kv_cache.device, self.sliding_window)
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
        contexts; mask [1, G, 1, ctx_len] (bool: True = attend, or additive). A soft-capped
        layer's scores are computed in float32 (`capped_attention`): [Hkv, G, H/Hkv,
        ctx_len], next to the contexts' float32 copies."""
        num_seqs, num_kv_heads, head_size = q.shape[0], self.num_kv_heads, self.head_size
        # Query heads sharing a kv head become that head's query rows: q [Hkv, G, H/Hkv, D].
        heads_per_kv = self.num_heads // num_kv_heads
        q = q.view(num_seqs, num_kv_heads, heads_per_kv, head_size).transpose(0, 1)
        if self.logits_soft_cap is not None:
            out = capped_attention(q, k_ctx, v_ctx, mask, self.scale, self.logits_soft_cap)
            return out.transpose(0, 1).reshape(num_seqs, self.num_heads, head_size)
        out = F.scaled_dot_product_attention(
            q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), attn_mask=mask, scale=self.scale
        )
        return out.transpose(0, 1).reshape(num_seqs, self.num_heads, head_size)


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"

    def workspace_bytes(self, layer: AttentionLayer, max_model_len: int) -> int:
        """A chunk over a cached context of max_model_len: the context gathered out of
        the cache (and cast), plus the bounded scores (CHUNK_SCORES_BYTES). A soft-capped
        layer computes its scores in float32 from float32 copies of the keys and values
        (`capped_attention`), at most a chunk's whole context or a decode group's
        (DECODE_GROUP_BYTES of the model's dtype); a float32 model copies nothing."""
        context = 2 * layer.num_kv_heads * max_model_len * layer.head_size
        workspace = context * layer.dtype.itemsize * 2 + CHUNK_SCORES_BYTES
        if layer.logits_soft_cap is not None and layer.dtype.itemsize < 4:
            workspace += max(context * 4, DECODE_GROUP_BYTES * 4 // layer.dtype.itemsize)
        return workspace

    def make_impl(self, layer: AttentionLayer) -> AttentionImpl:
        return TorchSDPAImpl(layer)

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        return TorchSDPAMetadata.from_common(common)
