"""Causal attention with explicit masks: a sliding window and Gemma 2's logit soft cap.

torch's scaled_dot_product_attention knows a causal mask but no window, and no soft
cap. A windowed layer attends with an explicit boolean mask (query at position p sees
keys at positions p - window < position <= p), which SDPA takes; a soft-capped layer
has its scores computed here in float32 (`capped_attention`), since the cap applies
between the product and the softmax, inside SDPA.

Both bound their memory the same way the SDPA backend's chunk path does: the queries
are split into rows whose scores, probabilities and mask ([H, rows, keys]) stay under
CHUNK_SCORES_BYTES, and with a window each row block reads only the keys its window
reaches. `causal_sdpa` attends one whole sequence with them where it needs a mask and
with one SDPA call where not: `Attention.forward` without metadata (the profile run and
`model(input_ids, positions)`) and the SDPA backend's prefills. Used by the SDPA and CPU
backends too, on every rank alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The scores of one masked call (float32 scores and probabilities and the boolean mask,
# [H, query rows, keys]) stay under this many bytes: 2k queries at 32k context and 32
# heads would otherwise need about 8 GiB, which no profile run sees.
CHUNK_SCORES_BYTES = 256 << 20
# Bytes per score element of a masked call: float32 scores, float32 probabilities, the
# boolean mask (SDPA's math kernel, and `capped_attention`, hold all three at once).
SCORE_ELEMENT_BYTES = 4 + 4 + 1


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     soft_cap: float | None) -> torch.Tensor:
    """softmax(cap(q k^T * scale) + mask) v, in float32, returned in q's dtype.

    q [..., n, D], k and v [..., L, D] with batch dimensions torch.matmul broadcasts
    (a GQA group's query heads as a dimension of q against a size-1 one of k);
    `mask` broadcastable to [..., n, L], boolean (True: attend) or additive. Every
    query row must see at least one key. Holds float32 scores and probabilities
    [..., n, L] and, for a non-float32 model, float32 copies of q, k and v."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if soft_cap is not None:
        scores.div_(soft_cap).tanh_().mul_(soft_cap)
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    else:
        scores.add_(mask)
    probs = torch.softmax(scores, dim=-1)
    del scores
    return torch.matmul(probs, v.float()).to(q.dtype)


def query_rows_per_call(num_heads: int, num_keys: int, sliding_window: int | None) -> int:
    """How many query rows one masked call takes so that its scores stay under
    CHUNK_SCORES_BYTES (read at each call) over `num_keys` keys; with a window of w, a
    block of r <= w rows reads fewer than r + w <= 2w keys, so up to w rows fit where
    2w keys per row do."""
    budget = CHUNK_SCORES_BYTES
    per_row = num_heads * SCORE_ELEMENT_BYTES
    rows = max(1, budget // (per_row * max(num_keys, 1)))
    if sliding_window is not None and sliding_window < num_keys:
        rows = max(rows, min(sliding_window, budget // (per_row * 2 * sliding_window)))
    return rows


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int = 0,
                     k_start: int = 0, sliding_window: int | None = None,
                     soft_cap: float | None = None) -> torch.Tensor:
    """Queries q [n, H, D] at positions q_start .. q_start + n - 1 against keys and
    values k, v [Hkv, L, D] at positions k_start .. k_start + L - 1 (H a multiple of
    Hkv): a query at position p sees the keys at positions <= p and, with a window,
    > p - sliding_window. The keys must cover all that any query sees (k_start <=
    max(0, q_start - sliding_window + 1), or 0 without a window, and k_start + L >=
    q_start + n). Returns [n, H, D] in q's dtype.

    Rows are taken in blocks of `query_rows_per_call`; each block is one SDPA call with
    a boolean mask, or, with a soft cap, one `capped_attention` call. Holds at most
    CHUNK_SCORES_BYTES of scores at a time besides the output."""
    num_queries, num_heads, head_size = q.shape
    num_kv_heads, num_keys = k.shape[0], k.shape[1]
    heads_per_kv = num_heads // num_kv_heads
    rows = query_rows_per_call(num_heads, num_keys, sliding_window)
    out = torch.empty_like(q)
    for lo in range(0, num_queries, rows):
        hi = min(lo + rows, num_queries)
        first, last = q_start + lo, q_start + hi - 1
        k_lo = 0 if sliding_window is None else max(0, first - sliding_window + 1 - k_start)
        k_hi = last + 1 - k_start
        q_pos = torch.arange(first, last + 1, device=q.device).unsqueeze(1)
        k_pos = torch.arange(k_start + k_lo, k_start + k_hi, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        block = q[lo:hi].transpose(0, 1)  # [H, r, D]
        keys, values = k[:, k_lo:k_hi], v[:, k_lo:k_hi]
        if soft_cap is None:
            res = F.scaled_dot_product_attention(
                block.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale,
                enable_gqa=heads_per_kv > 1,
            ).squeeze(0)
        else:
            # A GQA group's query heads as a dimension that matmul broadcasts kv heads over.
            grouped = block.reshape(num_kv_heads, heads_per_kv, hi - lo, head_size)
            res = capped_attention(grouped, keys.unsqueeze(1), values.unsqueeze(1), mask, scale, soft_cap)
            res = res.reshape(num_heads, hi - lo, head_size)
        out[lo:hi] = res.transpose(0, 1)
    return out


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence: q [T, H, D], k and v [T, Hkv, D] -> [T, H, D].

    A window shorter than the sequence, or a soft cap, takes `causal_attention`'s
    explicit masks, in query blocks whose scores stay under CHUNK_SCORES_BYTES; without
    either, one causal SDPA call (its flash kernel, no mask).

    On CUDA the kv heads are repeated for GQA instead of asking SDPA for `enable_gqa`,
    which only its flash kernel takes: a float32 model would otherwise fall to the
    math kernel, whose [H, T, T] scores grow with the square of the prompt (the
    profile run at max_num_batched_tokens among them). The copies are O(T)."""
    if soft_cap is not None or (sliding_window is not None and sliding_window < q.shape[0]):
        return causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale, sliding_window=sliding_window,
                                soft_cap=soft_cap)
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda:
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=gqa,
    )
    return out.squeeze(0).transpose(0, 1)
