"""unified_attention: paged attention for every sequence of a step in one Triton launch.

Called by TritonAttentionImpl.forward (every rank, the model's thread) after
reshape_and_cache has put the step's K/V into the cache. Sequence i owns query rows
[query_start_loc[i], query_start_loc[i+1]) and has seq_lens[i] tokens of context after
the step; its first seq_len - query_len tokens were cached before (a prefix-cache hit, or
the chunks before this one), the rest are the query rows themselves, attended causally. A
decode is the case query_len == 1, a whole-prompt prefill the case query_len == seq_len:
there is no separate path.

The tiling. The query heads that share a kv head are the rows of one tile, together with
BLOCK_Q consecutive query tokens (row r = token r // heads_per_kv, head r % heads_per_kv),
padded to BLOCK_M >= 16 rows as tl.dot wants; each program takes one such tile of one
sequence and one kv head, and walks its context BLOCK_N keys at a time with an online
softmax in float32. Each key's physical block is looked up in the block table per token,
so block_size is any positive integer; head sizes are padded to a power of two with
masks. K/V are read where they lie in the cache: nothing is gathered, and nothing is
allocated but the output.

The grid. Program p along axis 0 finds its sequence by binary search over
query_start_loc // BLOCK_Q + i (an upper bound of the tiles before sequence i), so the
grid is num_tokens // BLOCK_Q + num_seqs programs, or num_tokens when BLOCK_Q == 1 (a
decode batch): it depends on no sequence length. Every length is read from the device
tensors inside the kernel, so a decode launch captured in a CUDA graph replays with new
seq_lens, and no forward waits on the host.

Padding rows are safe: a sequence with seq_len 0 has no keys, and a row without keys
writes zeros, never NaN. Rows of `out` past query_start_loc[num_seqs] are not written.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (read, as Triton reads it, when this module is imported) runs
# bfloat16 arithmetic wrong, whatever the tensors' device: operands are upcast there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _unified_attention_kernel(
    q_ptr, kv_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, scale, sliding_window, soft_cap, block_size,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_block_table,
    HEADS_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence: the last i whose first tile index, query_start_loc[i] // BLOCK_Q (+ i
    # where a sequence may end in a partial tile), is <= tile.
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q
        if BLOCK_Q > 1:
            first_tile += mid
        before = first_tile <= tile
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid)
    seq = lo
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_tile = query_start // BLOCK_Q
    if BLOCK_Q > 1:
        first_tile += seq
    q_block = tile - first_tile
    if q_block * BLOCK_Q >= query_len:  # the bound's spare tiles, and empty sequences
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len  # tokens cached before this step's chunk

    rows = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + rows // HEADS_PER_KV  # within the sequence's chunk
    head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV
    row_valid = (rows < BLOCK_Q * HEADS_PER_KV) & (token < query_len)
    position = context_len + token  # the query's position in its sequence
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    row_offset = (query_start + token).to(tl.int64)
    q = tl.load(q_ptr + row_offset[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST_OPERANDS:
        q = q.to(tl.float32)

    # The keys any row of this tile may see: up to its last query's position, and from
    # its first query's window start.
    last_token = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, query_len) - 1
    kv_end = context_len + last_token + 1
    kv_start = 0
    if USE_SLIDING_WINDOW:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)

    LOG2E: tl.constexpr = 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for start in range(kv_start, kv_end, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_valid = key_pos < kv_end
        block = tl.load(block_table + key_pos // block_size, mask=key_valid, other=0).to(tl.int64)
        slot = block * stride_cache_block + (key_pos % block_size) * stride_cache_slot + kv_head * stride_cache_head
        kv_mask = key_valid[None, :] & dim_valid[:, None]
        k = tl.load(kv_cache_ptr + slot[None, :] + dims[:, None], mask=kv_mask, other=0.0)  # [D, N]
        v = tl.load(kv_cache_ptr + stride_cache_kv + slot[:, None] + dims[None, :], mask=tl.trans(kv_mask),
                    other=0.0)  # [N, D]
        if UPCAST_OPERANDS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:  # soft_cap * tanh(s / soft_cap), tanh from exp (no libdevice)
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        s = s * LOG2E
        visible = key_valid[None, :] & (key_pos[None, :] <= position[:, None])
        if USE_SLIDING_WINDOW:
            visible = visible & (key_pos[None, :] > position[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet (padding, or a window starting later) keeps
        # max -inf; subtract 0 instead so that exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offset = row_offset[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def _tile_shape(heads_per_kv: int, head_size_padded: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N). A decode batch takes one token per tile (its other rows
    would be empty); a prefill packs BLOCK_M // heads_per_kv tokens into 64 rows."""
    rows_min = 16 if max_query_len <= 1 else 64
    block_m = max(rows_min, triton.next_power_of_2(heads_per_kv))
    block_q = 1 if max_query_len <= 1 else block_m // heads_per_kv
    block_n = 64 if head_size_padded <= 128 else 32
    return block_m, block_q, block_n


def unified_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
    sliding_window: int | None = None, soft_cap: float | None = None,
) -> torch.Tensor:
    """Attend q [T, num_heads, head_size] to the paged `kv_cache` [num_blocks, 2,
    block_size, num_kv_heads, head_size] into `out` (q's shape; any dtype) and return it.

    block_tables [num_seqs, max_blocks], seq_lens [num_seqs] and query_start_loc
    [num_seqs + 1] are int32 or int64 tensors on q's device; max_query_len is an upper
    bound of the query lengths (1 for a decode batch; it picks the tile shape only). A
    query at position p sees keys at positions <= p, and > p - sliding_window when one
    is given. Softmax and accumulation run in float32. On CUDA 16-bit operands stay 16-bit
    (tensor cores) and float32 ones use full precision (not tf32); under Triton's
    interpreter (CPU tensors), whose bfloat16 arithmetic is wrong, operands are upcast to
    float32.
    Launches on the current stream and never synchronises."""
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and kv_cache.shape[4] == head_size and out.shape == q.shape
    assert kv_cache.is_contiguous() and query_start_loc.shape[0] == num_seqs + 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert out.stride(-1) == 1
    heads_per_kv = num_heads // num_kv_heads
    head_size_padded = max(16, triton.next_power_of_2(head_size))
    block_m, block_q, block_n = _tile_shape(heads_per_kv, head_size_padded, max_query_len)
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    upcast = q.device.type == "cpu" or _INTERPRETED
    _unified_attention_kernel[(num_tiles, num_kv_heads)](
        q, kv_cache, out, block_tables, seq_lens, query_start_loc,
        num_seqs, scale, sliding_window or 0, soft_cap or 0.0, kv_cache.shape[2],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        HEADS_PER_KV=heads_per_kv, HEAD_SIZE=head_size, HEAD_SIZE_PADDED=head_size_padded,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        USE_SLIDING_WINDOW=bool(sliding_window), USE_SOFT_CAP=bool(soft_cap),
        UPCAST_OPERANDS=upcast, DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
    )
    return out
