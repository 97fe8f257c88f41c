"""TritonAttentionBackend (vLLM's TRITON_ATTN): paged attention in two Triton kernels.

Each layer's forward writes the step's K/V into its paged cache (`reshape_and_cache`)
and attends every sequence of the step in one launch (`unified_attention`), reading K/V
through the block table where they lie: no gather into dense tensors, no mask tensors,
no per-sequence calls. The default on CUDA; on the CPU it runs under Triton's
interpreter (TRITON_INTERPRET=1, set before this module is imported), which is how CI
tests it.

The step's metadata is built once per step (`build_metadata`) as device tensors plus
host ints; a forward reads nothing else, so it never waits on the host, and a decode
step captured in a CUDA graph replays with new lengths written into the same tensors
(`TritonAttentionMetadata.from_device_tensors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.layers.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionLayer, AttentionMetadata
from models.layers.attention.ops.triton_reshape_and_cache import reshape_and_cache
from models.layers.attention.ops.triton_unified_attention import unified_attention


@dataclass
class TritonAttentionMetadata:
    """One step's batch as device tensors, shared by every layer of the step.

    Sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]) and has
    seq_lens[i] tokens of context after this step, in the blocks block_tables[i] lists
    (entries past its blocks are never read). Every tensor is on the model's device;
    nothing here is a host list, so the kernels take them as they are.

    Padding rows (a batch padded to a captured CUDA graph size): a sequence with seq_len
    0 and zero query tokens, or one query token whose slot is -1, writes nothing to the
    cache and attends to nothing (its output row is zeros).
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset per token; < 0 = no write
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 or int64
    seq_lens: torch.Tensor  # [num_seqs] int32 or int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 or int64
    block_size: int
    num_seqs: int
    max_query_len: int  # an upper bound; 1 = a decode batch (the kernels' tile shape)

    @classmethod
    def from_common(cls, common: AttentionMetadata) -> TritonAttentionMetadata:
        """From the runner's common metadata: its device copies of the lengths where it
        sent them (`seq_lens_tensor`, `query_start_loc_tensor`), else one host-to-device
        copy of its lists, once per step; the slot mapping and block tables are used as
        they are (already on the device)."""
        seq_lens, query_start_loc = common.seq_lens, common.query_start_loc
        num_seqs = len(seq_lens)
        max_query_len = max((query_start_loc[i + 1] - query_start_loc[i] for i in range(num_seqs)), default=0)
        if common.seq_lens_tensor is not None and common.query_start_loc_tensor is not None:
            return cls(common.slot_mapping, common.block_tables, common.seq_lens_tensor,
                       common.query_start_loc_tensor, common.block_size, num_seqs, max_query_len)
        device = common.block_tables.device
        lengths = torch.tensor(seq_lens + query_start_loc, dtype=torch.int32, device=device)
        return cls(common.slot_mapping, common.block_tables, lengths[:num_seqs], lengths[num_seqs:],
                   common.block_size, num_seqs, max_query_len)

    @classmethod
    def from_device_tensors(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, block_size: int,
                            max_query_len: int) -> TritonAttentionMetadata:
        """From tensors already on the device (the CUDA graph runner's persistent
        buffers, sliced to the padded batch): nothing is copied or read back. The
        kernels' launch grids then depend only on the tensors' shapes, and for
        max_query_len == 1 only on num_seqs = seq_lens.shape[0], so a graph captured
        with these tensors replays correctly after new values are copied into them."""
        num_seqs = seq_lens.shape[0]
        if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} and query_start_loc "
                             f"{tuple(query_start_loc.shape)} do not match seq_lens of {num_seqs} sequences")
        return cls(slot_mapping, block_tables, seq_lens, query_start_loc, block_size, num_seqs, max_query_len)


class TritonAttentionImpl(AttentionImpl):
    """One layer's Triton paged attention; keeps no state between steps."""

    def __init__(self, layer: AttentionLayer) -> None:
        super().__init__(layer)
        # Gemma 2's logit soft cap, where a layer declares one (ours do not yet).
        self.logits_soft_cap: float | None = getattr(layer, "logits_soft_cap", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: TritonAttentionMetadata) -> torch.Tensor:
        """The step's K/V into the cache at md.slot_mapping, then every sequence's queries
        against its cached context. Two launches on the current stream, no host sync;
        allocates the output only. Rows of the output past the last sequence's query rows
        are left unwritten."""
        reshape_and_cache(k, v, kv_cache, md.slot_mapping)
        out = torch.empty_like(q)
        return unified_attention(q, kv_cache, out, md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.max_query_len, self.scale, self.sliding_window, self.logits_soft_cap)


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"
    supports_cuda_graphs = True

    def make_impl(self, layer: AttentionLayer) -> AttentionImpl:
        return TritonAttentionImpl(layer)

    def build_metadata(self, common: AttentionMetadata) -> TritonAttentionMetadata:
        return TritonAttentionMetadata.from_common(common)

    def make_decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                             block_size: int) -> TritonAttentionMetadata:
        """A decode batch over the CUDA graph runner's persistent buffers (views, read
        in place at every replay); see TritonAttentionMetadata.from_device_tensors."""
        return TritonAttentionMetadata.from_device_tensors(slot_mapping, block_tables, seq_lens, query_start_loc,
                                                           block_size, max_query_len=1)

    def workspace_bytes(self, layer: AttentionLayer, max_model_len: int) -> int:
        """None: the kernels read the cache in place and allocate only the output."""
        return 0
