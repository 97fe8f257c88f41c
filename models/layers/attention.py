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
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.decode_context import DecodeContext

# Decode sequences are attended in groups whose padded K/V context (gathered from the
# paged cache) stays under this many bytes; see Attention._decode_attention.
DECODE_GROUP_BYTES = 8 << 20


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences attended in one SDPA call, with their gather indices and mask."""

    rows: torch.Tensor | None  # positions in the decode batch; None = all of it, in order
    blocks: torch.Tensor  # [G * num_blocks] cache block ids to gather (padding clamped to 0)
    mask: torch.Tensor  # [1, G, 1, ctx_len]: True where a key is real context
    ctx_len: int


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
    # One int per sequence, equal across steps for as long as the sequence's cached K/V
    # stays the same (the runner's per-request serial numbers); lets decode steps reuse
    # last step's gathered context (DecodeContext). None: gather every step.
    seq_keys: tuple[int, ...] | None = None

    # Derived once per step, on first use by the first layer, then shared by all layers.
    @cached_property
    def slot_blocks_and_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slot_mapping // self.block_size, self.slot_mapping % self.block_size

    def decode_groups(self, bytes_per_token: int, device: torch.device) -> list[DecodeGroup]:
        """The grouping of the decode sequences (see Attention._decode_attention), built
        by the first layer and reused by the others (they share `bytes_per_token`)."""
        cache: dict[int, list[DecodeGroup]] = self.__dict__.setdefault("_decode_groups", {})
        if bytes_per_token not in cache:
            cache[bytes_per_token] = self._build_decode_groups(bytes_per_token, device)
        return cache[bytes_per_token]

    def _build_decode_groups(self, bytes_per_token: int, device: torch.device) -> list[DecodeGroup]:
        seqs, block_size = self.decode_seqs, self.block_size
        order = sorted(range(len(seqs)), key=lambda t: self.seq_lens[seqs[t]])
        members: list[list[int]] = [[]]
        for t in order:
            padded_len = -(-self.seq_lens[seqs[t]] // block_size) * block_size
            if members[-1] and (len(members[-1]) + 1) * padded_len * bytes_per_token > DECODE_GROUP_BYTES:
                members.append([])
            members[-1].append(t)
        identity = len(members) == 1 and order == list(range(len(seqs)))
        groups = []
        for member in members:
            group_seqs = [seqs[t] for t in member]
            seq_lens = torch.tensor([self.seq_lens[i] for i in group_seqs], dtype=torch.long, device=device)
            num_blocks = -(-max(self.seq_lens[i] for i in group_seqs) // block_size)
            ctx_len = num_blocks * block_size
            table_rows = torch.tensor(group_seqs, dtype=torch.long, device=self.block_tables.device)
            # Table padding is masked out below; clamp it so any fill value is a valid index.
            blocks = self.block_tables[table_rows, :num_blocks].clamp(min=0).reshape(-1).to(device)
            mask = (torch.arange(ctx_len, device=device) < seq_lens.unsqueeze(1)).view(1, len(member), 1, ctx_len)
            rows = None if identity else torch.tensor(member, dtype=torch.long, device=device)
            groups.append(DecodeGroup(rows, blocks, mask, ctx_len))
        return groups

    @cached_property
    def decode_seqs(self) -> list[int]:
        """Sequences whose chunk is a single query token."""
        qsl = self.query_start_loc
        return [i for i in range(len(self.seq_lens)) if qsl[i + 1] - qsl[i] == 1]

    # The decode batch as DecodeContext sees it (shared by all layers of the step).
    @cached_property
    def decode_keys(self) -> tuple[int, ...] | None:
        return None if self.seq_keys is None else tuple(self.seq_keys[i] for i in self.decode_seqs)

    @cached_property
    def decode_lens(self) -> tuple[int, ...]:
        return tuple(self.seq_lens[i] for i in self.decode_seqs)

    @cached_property
    def decode_prev_lens(self) -> tuple[int, ...]:
        return tuple(n - 1 for n in self.decode_lens)

    def decode_append_index(self, capacity: int) -> torch.Tensor:
        """row * capacity + position of each decode sequence's new token, in a
        [G, capacity] layout (one per capacity, shared by the layers)."""
        cache: dict[int, torch.Tensor] = self.__dict__.setdefault("_decode_append_index", {})
        if capacity not in cache:
            device = self.slot_mapping.device
            rows = torch.arange(len(self.decode_lens), device=device)
            cache[capacity] = rows * capacity + torch.tensor(self.decode_prev_lens, dtype=torch.long, device=device)
        return cache[capacity]

    @cached_property
    def decode_gather_blocks(self) -> tuple[torch.Tensor, int]:
        """The decode sequences' block ids, each row padded to the longest (padding
        clamped to block 0, masked later), flattened; and that padded length in tokens."""
        num_blocks = -(-max(self.decode_lens) // self.block_size)
        rows = torch.tensor(self.decode_seqs, dtype=torch.long, device=self.block_tables.device)
        blocks = self.block_tables[rows, :num_blocks].clamp(min=0).reshape(-1).to(self.slot_mapping.device)
        return blocks, num_blocks * self.block_size

    def decode_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[1, G, 1, max decode len] additive mask: 0 on each sequence's context, -inf past it."""
        masks: dict[torch.dtype, torch.Tensor] = self.__dict__.setdefault("_decode_masks", {})
        if dtype not in masks:
            device = self.slot_mapping.device
            ctx_len = max(self.decode_lens)
            lens = torch.tensor(self.decode_lens, dtype=torch.long, device=device)
            past = torch.arange(ctx_len, device=device) >= lens.unsqueeze(1)
            mask = torch.zeros(past.shape, dtype=dtype, device=device).masked_fill_(past, float("-inf"))
            masks[dtype] = mask.view(1, len(self.decode_lens), 1, ctx_len)
        return masks[dtype]


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
        self.decode_context = DecodeContext()

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
        block_ids, offsets = md.slot_blocks_and_offsets
        cache[block_ids, 0, offsets] = k.to(cache.dtype)
        cache[block_ids, 1, offsets] = v.to(cache.dtype)
        qsl = md.query_start_loc
        num_seqs = len(md.seq_lens)
        decodes = md.decode_seqs
        if len(decodes) == num_seqs:  # pure decode: token i belongs to sequence i
            return self._decode_attention(q, k, v, md)
        out = torch.empty_like(q)
        if decodes:
            rows = torch.tensor([qsl[i] for i in decodes], dtype=torch.long, device=q.device)
            out[rows] = self._decode_attention(q[rows], k[rows], v[rows], md)
        for i in range(num_seqs):
            start, end = qsl[i], qsl[i + 1]
            if end - start > 1:
                out[start:end] = self._chunk_attention(q[start:end], k[start:end], v[start:end], md, i)
        return out

    def _chunk_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, i: int
    ) -> torch.Tensor:
        """Sequence i's query chunk q [n, H, D] (new keys and values k, v) against its
        whole cached context."""
        seq_len, query_len = md.seq_lens[i], q.shape[0]
        cache = self.kv_cache
        assert cache is not None
        if seq_len == query_len and cache.dtype == q.dtype:  # a whole prompt: the chunk is the context
            return self._sdpa(q, k, v, mask=None)
        num_blocks = -(-seq_len // md.block_size)
        blocks = md.block_tables[i, :num_blocks]
        k_ctx = cache[blocks, 0].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len].to(q.dtype)
        v_ctx = cache[blocks, 1].reshape(-1, self.num_kv_heads, self.head_size)[:seq_len].to(q.dtype)
        # Query j sits at position seq_len - query_len + j and sees keys up to it.
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        return self._sdpa(q, k_ctx, v_ctx, mask=k_pos <= q_pos)

    def _decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q [len(md.decode_seqs), H, D]: the one (last) query token of each decode
        sequence; k, v its new key and value (already in the paged cache).

        When the batch continues the previous step's, `DecodeContext` holds the whole
        context contiguously and one SDPA call covers the batch. Otherwise sequences are
        sorted by length and split into groups whose padded context stays under
        DECODE_GROUP_BYTES: one big padded gather costs more than it saves (page faults,
        padding), many tiny calls cost per-call overhead. The grouping and its index
        tensors depend only on the step, so every layer reuses the first one's.
        """
        cache = self.kv_cache
        assert cache is not None
        context = self.decode_context.get(cache, md, k, v)
        if context is not None:
            ctx_len = max(md.decode_lens)
            return self._attend_padded(q, context[0, :, :, :ctx_len], context[1, :, :, :ctx_len],
                                       md.decode_mask(q.dtype))
        bytes_per_token = 2 * self.num_kv_heads * self.head_size * cache.element_size()
        groups = md.decode_groups(bytes_per_token, cache.device)
        if len(groups) == 1 and groups[0].rows is None:
            return self._decode_group(q, groups[0])
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = self._decode_group(q[group.rows], group)
        return out

    def _decode_group(self, q: torch.Tensor, group: "DecodeGroup") -> torch.Tensor:
        """One SDPA call for the single query token of each sequence in `group` (q [G, H, D])."""
        cache = self.kv_cache
        assert cache is not None
        num_seqs, num_kv_heads, head_size = q.shape[0], self.num_kv_heads, self.head_size
        # cache [N, 2, bs, Hkv, D] viewed as [2, Hkv, N, bs, D]; index_select writes a
        # contiguous [2, Hkv, G * nb, bs, D], i.e. [2, Hkv, G, ctx_len, D] per head.
        ctx = cache.permute(1, 3, 0, 2, 4).index_select(2, group.blocks)
        ctx = ctx.view(2, num_kv_heads, num_seqs, group.ctx_len, head_size)
        return self._attend_padded(q, ctx[0], ctx[1], group.mask)

    def _attend_padded(
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
