"""CPUAttentionBackend: the SDPA backend with a paged decode kernel on the CPU.

Decode tokens (one query per sequence) are attended by a small C kernel that reads each
sequence's own blocks where they lie in the paged cache (`paged_decode.py`): torch's
flash kernel over a gathered, padded batch took 3-4x as long. A batch whose sequences
share leading blocks (the prefix cache gives one system prompt's blocks to every
request) is attended in cascade: the shared prefix once for the whole batch, as one
flash call, each sequence's own tokens after it by the kernel, merged by log-sum-exp.
A step with prefill chunks goes to the kernel too, in one call, every query token of
the step a query of its own against the positions up to it: torch's causal flash
kernel, one call per sequence, took 2-3x as long (`paged_decode.py`). A step with a
context longer than the kernel's path was measured to win at (PREFILL_KERNEL_MAX_CONTEXT,
or PREFILL_KERNEL_MAX_CONTEXT_AVX512 on the AVX-512 path) goes to the SDPA backend.

Where the kernel cannot be built (no C compiler), each layer's impl instead keeps the
decode batch's K/V contiguously across steps (`DecodeContext`) and appends one token per
step, since gathering every sequence's blocks each step cost about as much as the
attention itself; the cascade keeps what follows the prefix in a second decode context;
any other step falls back to the SDPA backend's grouped gather. The paged cache stays
the source of truth.

A layer with a sliding window or a logit soft cap (Gemma 2) takes the kernel, which
knows both, for decode and prefill alike. Without the kernel it is attended as the
SDPA backend does, with explicit masks: the decode contexts and the cascade know
neither. A window longer than every context of the step changes nothing, so such a
step keeps all the paths above.

To know that a batch "continues the previous step", the backend gives each live
request a serial key: a finished, aborted or preempted request loses it (the runner
passes the scheduler's finished ids to `requests_finished`), so a reused request id or
a recomputed sequence never matches K/V kept from before. Every rank sees the same
steps, so every rank assigns the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import torch

from distributed.utils import cdiv
from models.layers.attention.backends.abstract import AttentionImpl, AttentionLayer, AttentionMetadata, gather_paged_kv
from models.layers.attention.backends.decode_context import TOTAL_BYTES, DecodeContext
from models.layers.attention.backends.paged_decode import PagedDecodeKernel, load as load_paged_decode
from models.layers.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAImpl, TorchSDPAMetadata

# A shared prefix shorter than this is attended per sequence like the rest of the context.
CASCADE_MIN_TOKENS = 64
# The longest context the kernel takes a prefill step for. Each query token reads its
# sequence's whole K/V up to it, which pays while that K/V stays in the caches. The
# portable path was level with torch's flash kernel at 512 tokens and 1.7x slower at 2048;
# the AVX-512 path was ahead at every length measured, up to 8192 (0.61 against 0.78 s).
PREFILL_KERNEL_MAX_CONTEXT = 512
PREFILL_KERNEL_MAX_CONTEXT_AVX512 = 8192


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp per query row (torch's CPU flash kernel, which
    F.scaled_dot_product_attention calls without returning the second)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )[:2]
    return out, lse


@dataclass
class CPUAttentionMetadata(TorchSDPAMetadata):
    """Adds one key per sequence, equal across steps for as long as the sequence's
    cached K/V stays the same, and the decode batch as `DecodeContext` sees it (all
    derived once per step and shared by the layers)."""

    seq_keys: tuple[int, ...] = ()

    @cached_property
    def decode_keys(self) -> tuple[int, ...]:
        return tuple(self.seq_keys[i] for i in self.decode_seqs)

    @cached_property
    def decode_lens(self) -> tuple[int, ...]:
        return tuple(self.seq_lens[i] for i in self.decode_seqs)

    @cached_property
    def decode_prev_lens(self) -> tuple[int, ...]:
        return tuple(n - 1 for n in self.decode_lens)

    def decode_append_index(self, capacity: int, start: int = 0) -> torch.Tensor:
        """row * capacity + position - start of each decode sequence's new token, in a
        [G, capacity] layout (one per capacity and start, shared by the layers)."""
        cache: dict[tuple[int, int], torch.Tensor] = self.__dict__.setdefault("_decode_append_index", {})
        if (capacity, start) not in cache:
            device = self.slot_mapping.device
            rows = torch.arange(len(self.decode_lens), device=device)
            prev = torch.tensor(self.decode_prev_lens, dtype=torch.long, device=device) - start
            cache[capacity, start] = rows * capacity + prev
        return cache[capacity, start]

    @cached_property
    def decode_tables_and_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode sequences' block-table rows and context lengths, as the paged
        decode kernel takes them."""
        seqs = self.decode_seqs
        tables = self.block_tables
        if len(seqs) != len(self.seq_lens):
            tables = tables[torch.tensor(seqs, dtype=torch.long, device=tables.device)]
        return tables, torch.tensor(self.decode_lens, dtype=torch.long)

    @cached_property
    def token_tables_and_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query token of the step as the paged decode kernel takes a sequence: its
        sequence's block-table row, and its position + 1 (the query at position p sees
        positions 0..p). Decode tokens come out as `decode_tables_and_lens` has them."""
        qsl = self.query_start_loc
        counts = [qsl[i + 1] - qsl[i] for i in range(len(self.seq_lens))]
        lens = [p + 1 for seq_len, n in zip(self.seq_lens, counts) for p in range(seq_len - n, seq_len)]
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
        return self.block_tables[rows.to(self.block_tables.device)], torch.tensor(lens, dtype=torch.long)

    @cached_property
    def decode_gather_blocks(self) -> tuple[torch.Tensor, int]:
        """The decode sequences' block ids, each row padded to the longest (padding
        clamped to block 0, masked later), flattened; and that padded length in tokens."""
        num_blocks = cdiv(max(self.decode_lens), self.block_size)
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


    @cached_property
    def decode_shared_prefix(self) -> tuple[torch.Tensor, int] | None:
        """The leading blocks every decode sequence shares (the prefix cache hands one
        prompt's blocks to many requests), as (block ids, tokens), when there are at
        least CASCADE_MIN_TOKENS of them and two sequences; each sequence keeps at least
        one token of its own past them. None otherwise."""
        seqs = self.decode_seqs
        if len(seqs) < 2:
            return None
        max_shared = min((n - 1) // self.block_size for n in self.decode_lens)
        if max_shared * self.block_size < CASCADE_MIN_TOKENS:
            return None
        rows = self.block_tables[torch.tensor(seqs, dtype=torch.long, device=self.block_tables.device), :max_shared]
        differs = (rows != rows[0]).any(0)
        num_shared = int(differs.int().argmax()) if bool(differs.any()) else max_shared
        if num_shared * self.block_size < CASCADE_MIN_TOKENS:
            return None
        return rows[0, :num_shared].to(self.slot_mapping.device), num_shared * self.block_size

    def decode_suffix_gather(self, prefix_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The decode sequences' blocks after the shared prefix, padded to the longest and
        flattened; that padded length; and its [1, G, 1, len] additive mask."""
        cache: dict[torch.dtype, tuple] = self.__dict__.setdefault("_decode_suffix", {})
        if dtype not in cache:
            first = prefix_len // self.block_size
            num_blocks = cdiv(max(self.decode_lens), self.block_size)
            rows = torch.tensor(self.decode_seqs, dtype=torch.long, device=self.block_tables.device)
            blocks = self.block_tables[rows, first:num_blocks].clamp(min=0).reshape(-1).to(self.slot_mapping.device)
            ctx_len = (num_blocks - first) * self.block_size
            own = torch.tensor(self.decode_lens, dtype=torch.long, device=blocks.device) - prefix_len
            past = torch.arange(ctx_len, device=blocks.device) >= own.unsqueeze(1)
            mask = torch.zeros(past.shape, dtype=dtype, device=blocks.device).masked_fill_(past, float("-inf"))
            cache[dtype] = blocks, ctx_len, mask.view(1, len(self.decode_seqs), 1, ctx_len)
        return cache[dtype]


@dataclass
class CPUGraphDecodeMetadata:
    """A decode batch over a CPU graph's persistent buffers (`make_decode_metadata`):
    one query token per sequence; slot_mapping int64 [n], block_tables int64 [n,
    max_blocks], seq_lens int64 [n]. Nothing in it is a Python value of the step, so a
    recorded forward that read it reads the next step's buffers when replayed."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    block_size: int


class CPUAttentionImpl(TorchSDPAImpl):
    def __init__(self, layer: AttentionLayer, decode_context_bytes: int, kernel: PagedDecodeKernel | None) -> None:
        super().__init__(layer)
        self.kernel = kernel
        self.decode_context = DecodeContext(decode_context_bytes)
        # The cascade's: what follows the shared prefix, built once a batch repeats (a
        # server's cascade batches often change every step). At most one of the two
        # holds a buffer at a time, so a layer stays within its share of the budget.
        self.suffix_context = DecodeContext(decode_context_bytes, build_on_repeat=True)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """A step with prefill chunks: every query token by the kernel, in one call, where
        it takes them (see the module docstring); anything else as the SDPA backend
        does, with decode batches through `decode_attention`. A CPU graph's decode batch
        (`CPUGraphDecodeMetadata`) goes to the kernel, which reads every length from
        the buffers."""
        kernel = self.kernel
        if isinstance(md, CPUGraphDecodeMetadata):
            if (kernel is None or not kernel.supports(q, kv_cache)
                    or not kernel.write_kv(k, v, kv_cache, md.slot_mapping)):
                raise RuntimeError("a CPU graph's decode step needs the paged decode kernel, which declined it "
                                   "(the runner asks supports_cpu_graphs first)")
            return kernel(q, kv_cache, md.block_tables, md.seq_lens, self.scale, sliding_window=self.sliding_window,
                          soft_cap=self.logits_soft_cap)[0]
        if (kernel is None or not isinstance(md, CPUAttentionMetadata) or len(md.decode_seqs) == len(md.seq_lens)
                or not kernel.supports(q, kv_cache)):
            return super().forward(q, k, v, kv_cache, md)
        avx512 = kernel.avx512 and self.head_size in (64, 128)
        if max(md.seq_lens) > (PREFILL_KERNEL_MAX_CONTEXT_AVX512 if avx512 else PREFILL_KERNEL_MAX_CONTEXT):
            return super().forward(q, k, v, kv_cache, md)
        self.write_kv(k, v, kv_cache, md)
        tables, lens = md.token_tables_and_lens
        return kernel(q, kv_cache, tables, lens, self.scale, sliding_window=self.sliding_window,
                      soft_cap=self.logits_soft_cap)[0]

    def needs_masks(self, seq_lens: Iterable[int]) -> bool:
        """Whether this layer's step, with contexts of `seq_lens` tokens, needs a path that
        knows windows and soft caps (the kernel's, or the SDPA backend's masks): a soft
        cap, or a window some query sees past. A layer with neither answers without
        looking at the lengths."""
        if self.logits_soft_cap is not None:
            return True
        return self.sliding_window is not None and max(seq_lens) > self.sliding_window

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata) -> None:
        """The step's new keys and values into their slots: by the kernel's one pass where
        it takes them, else as the SDPA backend does."""
        if self.kernel is None or not self.kernel.write_kv(k, v, kv_cache, md.slot_mapping):
            super().write_kv(k, v, kv_cache, md)

    def decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, md: TorchSDPAMetadata
    ) -> torch.Tensor:
        """The kernel in place, or in cascade behind a shared prefix. Without it: when the
        batch continues the previous step's, the decode context holds the whole context
        contiguously and one SDPA call covers the batch; else the cascade, or the SDPA
        backend's grouped gather."""
        if not isinstance(md, CPUAttentionMetadata):
            return super().decode_attention(q, k, v, kv_cache, md)
        kernel = self.kernel if self.kernel is not None and self.kernel.supports(q, kv_cache) else None
        if self.needs_masks(md.decode_lens):
            # Nothing kept across steps is of use on these paths; later steps regather.
            self.decode_context.release()
            self.suffix_context.release()
            if kernel is None:
                return super().decode_attention(q, k, v, kv_cache, md)
            tables, lens = md.decode_tables_and_lens
            return kernel(q, kv_cache, tables, lens, self.scale, sliding_window=self.sliding_window,
                          soft_cap=self.logits_soft_cap)[0]
        if kernel is None:
            context = self.decode_context.get(kv_cache, md, k, v)
            if context is not None:
                self.suffix_context.release()
                ctx_len = max(md.decode_lens)
                return self.attend_padded(q, context[0, :, :, :ctx_len], context[1, :, :, :ctx_len],
                                          md.decode_mask(q.dtype))
        shared = md.decode_shared_prefix
        if shared is not None and kv_cache.device.type == "cpu":
            return self.cascade_decode(q, k, v, kv_cache, md, *shared, kernel)
        if kernel is not None:
            tables, lens = md.decode_tables_and_lens
            return kernel(q, kv_cache, tables, lens, self.scale)[0]
        return super().decode_attention(q, k, v, kv_cache, md)

    def cascade_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       md: CPUAttentionMetadata, prefix_blocks: torch.Tensor, prefix_len: int,
                       kernel: PagedDecodeKernel | None) -> torch.Tensor:
        """Decode attention in two parts merged by their log-sum-exp (cascade attention):
        every query of the batch against the shared prefix, gathered once, in one call;
        then each query against its own tokens after it: by `kernel` in place, or,
        without it, from the suffix context kept across steps (a fresh gather of them
        cost as much as the attention). Exact up to rounding: softmax over the union is
        the two softmaxes weighted by their normalisers."""
        num_seqs, heads_per_kv, head_size = q.shape[0], self.num_heads // self.num_kv_heads, self.head_size
        by_kv = q.view(num_seqs, self.num_kv_heads, heads_per_kv, head_size)
        prefix = gather_paged_kv(kv_cache, prefix_blocks, 1, prefix_len).to(q.dtype)
        q_prefix = by_kv.permute(1, 0, 2, 3).reshape(1, self.num_kv_heads, num_seqs * heads_per_kv, head_size)
        out_p, lse_p = _flash(q_prefix, prefix[0].view(1, self.num_kv_heads, prefix_len, head_size),
                              prefix[1].view(1, self.num_kv_heads, prefix_len, head_size), None, self.scale)
        # Both parts as [G, H, D] and [G, H, 1].
        out_p = out_p.view(self.num_kv_heads, num_seqs, heads_per_kv, head_size).transpose(0, 1)
        lse_p = lse_p.view(self.num_kv_heads, num_seqs, heads_per_kv).transpose(0, 1)
        out_p = out_p.reshape(num_seqs, self.num_heads, head_size)
        lse_p = lse_p.reshape(num_seqs, self.num_heads, 1).float()
        if kernel is not None:
            tables, lens = md.decode_tables_and_lens
            out_s, lse_s = kernel(q, kv_cache, tables, lens, self.scale, start=prefix_len, with_lse=True)
            lse_s = lse_s.unsqueeze(-1)
        else:
            out_s, lse_s = self._suffix_by_context(by_kv, k, v, kv_cache, md, prefix_len)
        top = torch.maximum(lse_p, lse_s)
        w_p, w_s = torch.exp(lse_p - top), torch.exp(lse_s - top)
        out = (out_p.float() * w_p + out_s.float() * w_s) / (w_p + w_s)
        return out.to(q.dtype)

    def _suffix_by_context(self, by_kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                           md: CPUAttentionMetadata, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cascade's second part without the kernel: queries by_kv [G, Hkv, H/Hkv, D]
        against each sequence's tokens after the prefix; (out [G, H, D], lse [G, H, 1])."""
        num_seqs = by_kv.shape[0]
        blocks, ctx_len, mask = md.decode_suffix_gather(prefix_len, by_kv.dtype)
        kept = self.suffix_context.get(kv_cache, md, k, v, start=prefix_len)
        if kept is not None:
            ctx_len = max(md.decode_lens) - prefix_len  # past it the mask is -inf anyway
            suffix, mask = kept[:, :, :, :ctx_len].to(by_kv.dtype), mask[..., :ctx_len]
        else:
            suffix = gather_paged_kv(kv_cache, blocks, num_seqs, ctx_len).to(by_kv.dtype)
        out_s, lse_s = _flash(by_kv.transpose(0, 1), suffix[0], suffix[1], mask, self.scale)
        out_s = out_s.transpose(0, 1).reshape(num_seqs, self.num_heads, self.head_size)
        lse_s = lse_s.transpose(0, 1).reshape(num_seqs, self.num_heads, 1).float()
        return out_s, lse_s


class CPUAttentionBackend(TorchSDPABackend):
    """One per rank. `decode_context_bytes`: all layers' decode buffers together (used
    only without the kernel). `paged_decode=False` keeps the kernel out even where it
    builds (the torch path's tests)."""

    name = "CPU_ATTN"

    def __init__(self, num_layers: int, decode_context_bytes: int = TOTAL_BYTES, paged_decode: bool = True) -> None:
        self.kernel = load_paged_decode() if paged_decode else None
        self.per_layer_bytes = decode_context_bytes // max(num_layers, 1)
        self.impls: list[CPUAttentionImpl] = []
        self._seq_keys: dict[str, int] = {}
        self._next_seq_key = 0

    def supports_cpu_graphs(self, kv_dtype: torch.dtype) -> bool:
        """Whether a decode step over a cache of `kv_dtype` can be recorded and replayed
        (worker/cpu_graph.py): the paged decode kernel, which reads every length and
        block from the graph's buffers, takes that dtype."""
        return self.kernel is not None and self.kernel.supports_dtype(kv_dtype)

    def make_decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, block_size: int) -> CPUGraphDecodeMetadata:
        """A decode batch over a CPU graph's buffers (int64 tables and lengths, refilled
        before every replay; no padding rows: the CPU graph runs each batch size as it
        is). `query_start_loc` is implied: one token per sequence."""
        return CPUGraphDecodeMetadata(slot_mapping, block_tables, seq_lens, block_size)

    @staticmethod
    def decode_shares_prefix(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> bool:
        """Whether a decode batch (host lists) would be attended in cascade: the host-side
        twin of `CPUAttentionMetadata.decode_shared_prefix`, so that such a step runs
        eagerly rather than replayed without its cascade."""
        if len(seq_lens) < 2:
            return False
        max_shared = min((n - 1) // block_size for n in seq_lens)
        shared = 0
        first = block_tables[0]
        while shared < max_shared and all(table[shared] == first[shared] for table in block_tables):
            shared += 1
        return shared * block_size >= CASCADE_MIN_TOKENS

    def make_impl(self, layer: AttentionLayer) -> AttentionImpl:
        impl = CPUAttentionImpl(layer, self.per_layer_bytes, self.kernel)
        self.impls.append(impl)
        return impl

    def reset(self) -> None:
        self._seq_keys.clear()
        for impl in self.impls:
            impl.decode_context.release()
            impl.suffix_context.release()

    def requests_finished(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._seq_keys.pop(req_id, None)
        if not self._seq_keys:  # nothing from before is still running: free the buffers
            for impl in self.impls:
                impl.decode_context.release()
                impl.suffix_context.release()

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        keys = []
        for req_id in common.req_ids:
            key = self._seq_keys.get(req_id)
            if key is None:
                key = self._seq_keys[req_id] = self._next_seq_key
                self._next_seq_key += 1
            keys.append(key)
        return CPUAttentionMetadata.from_common(common, seq_keys=tuple(keys))
