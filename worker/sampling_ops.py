"""The device half of drawing a token: temperature, top-k, top-p, min-p and the
inverse-CDF draw, batched over the rows that sample, on the logits' own device.

The Sampler calls these on every rank with the same tensors. Each op works row by row
(reductions, sorts and scans along the vocab only), so a row's result does not depend
on which other rows share its batch. On the CPU each row is bit for bit what the same
op gives on that row alone. Nothing here syncs with the host. The rare rows whose draw
needs a closer look are flagged for `fallback_token`, which runs on the host after the
step's one transfer.
"""

from __future__ import annotations

import math

import torch


def scale_by_temperature(logits: torch.Tensor, rows: torch.Tensor | None, temperature: torch.Tensor) -> torch.Tensor:
    """A new float32 tensor: `logits` rows `rows` (all when None) divided by
    `temperature` ([n, 1]), with NaN made -inf and +inf the largest float. A tiny
    temperature or penalty can overflow float32. +inf then becomes the likeliest token
    and NaN an impossible one, so softmax stays a distribution. -inf becomes the lowest
    float, as `nan_to_num` does."""
    scaled = logits / temperature if rows is None else logits.index_select(0, rows).div_(temperature)
    return scaled.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(scaled.dtype).max)


def _rows_of(tensor: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """`tensor` itself when `rows` names all its rows (no copy), else a copy of those rows."""
    return tensor if count == tensor.shape[0] else tensor.index_select(0, rows)


def apply_top_k(scaled: torch.Tensor, rows: torch.Tensor, top_k: torch.Tensor, max_k: int) -> None:
    """Mask to -inf, in place, the entries of `scaled` rows `rows` below that row's k-th
    largest value (k is `top_k`, [n, 1], each at most `max_k`). Ties with the k-th value
    stay, as `topk(row, k).values[-1]` decides. Temporaries: topk's [n, max_k] and a bool
    [rows, vocab]."""
    count = top_k.shape[0]
    kth = _rows_of(scaled, rows, count).topk(max_k, dim=-1).values.gather(1, top_k - 1)
    if count != scaled.shape[0]:
        threshold = torch.full((scaled.shape[0], 1), float("-inf"), dtype=scaled.dtype, device=scaled.device)
        kth = threshold.index_copy_(0, rows, kth)  # -inf: nothing is below it
    scaled.masked_fill_(scaled < kth, float("-inf"))


def apply_top_p(probs: torch.Tensor, rows: torch.Tensor, top_p: torch.Tensor) -> None:
    """Zero, in place, the tokens of `probs` rows `rows` outside that row's nucleus
    (`top_p`, [n, 1] float32). Sorted by probability, a token is dropped when the mass
    strictly before it already reaches top_p. The first token has none before it and
    always stays, even when top_p rounds to 0 in float32. Ties are ordered as `sort`
    orders them. Peak temporaries for n rows: the sorted probabilities, their int64
    order (two float32's worth), the cumulative sum, and two bool masks."""
    count = top_p.shape[0]
    subset = _rows_of(probs, rows, count)
    sorted_probs, order = subset.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)
    del sorted_probs
    drop_sorted = mass_before >= top_p
    del mass_before
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    del order, drop_sorted
    if count == probs.shape[0]:
        probs.masked_fill_(drop, 0.0)
    else:
        probs.index_copy_(0, rows, subset.masked_fill_(drop, 0.0))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """transformers' MinPLogitsWarper on probabilities, in place: zero every token less
    likely than `min_p` ([rows, 1] float32; 0 leaves a row as it is) times the row's
    likeliest one, which always stays."""
    probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)


def draw_by_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of the unnormalised distributions `probs` ([rows, vocab]),
    and a bool per row saying that `fallback_token` must decide it instead.

    Each row inverts its CDF at its own uniform (`uniforms`, float64): the first id
    whose cumulative mass exceeds u * total. The sums are float64, so an id of zero
    mass is never the first to exceed (on the CPU the running sum does not move at a
    zero). A row is flagged when its total is not a positive finite number, when u *
    total rounds up to the total, or when a parallel scan (CUDA) lands on an id of zero
    mass. torch.multinomial would draw from the same distribution. It took 0.85 ms per
    32k-token row here, and this takes ~0.06 ms. Temporaries: the float64 CDF (two
    float32's worth), freed before returning."""
    vocab = probs.shape[-1]
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    tokens = torch.searchsorted(cdf, (uniforms * total)[:, None], right=True)[:, 0]
    del cdf
    in_range = tokens.clamp(max=vocab - 1)
    drawn_mass = probs.gather(1, in_range[:, None])[:, 0]
    fine = torch.isfinite(total) & (total > 0) & (tokens < vocab) & (drawn_mass > 0)
    return in_range, ~fine


def fallback_token(probs_row: torch.Tensor, scaled_row: torch.Tensor, uniform: float) -> int:
    """The token of a row `draw_by_inverse_cdf` flagged, on the host (one row crosses).
    It is the first id with mass whose float64 cumulative mass exceeds u * total, else
    the last id with mass. With no mass to draw from (all zero, or NaN) it is the argmax
    of the temperature-scaled logits `scaled_row`, the likeliest token."""
    probs_row = probs_row.cpu()
    cdf = torch.cumsum(probs_row, dim=-1, dtype=torch.float64)
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0.0:
        return int(torch.argmax(scaled_row).item())
    past = torch.nonzero((cdf > uniform * total) & (probs_row > 0))
    if past.numel():
        return int(past[0, 0])
    return int(torch.nonzero(probs_row).max())
