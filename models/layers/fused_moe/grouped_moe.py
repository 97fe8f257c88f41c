"""The CPU experts kernel: the batch's tokens grouped by expert, one GEMM pair per expert.

Called by `FusedMoE.forward` on every rank (CPU tensors, but for a bf16 decode step's,
which `cpu_moe.py` computes in one C call; also CUDA where Triton is missing) with this
rank's stacked expert weights and the routing every rank computed alike; the quantised
experts' methods (fp8, int4/int8) call `grouped_experts` with their own products.
Instead of a loop over tokens, the (token, expert) pairs of the whole batch are sorted
by expert once; each active expert then gathers its tokens with one `index_select`,
runs its gate/up GEMM and its down GEMM once over all of them, and the routed-weighted
rows are scatter-added back into their tokens. The Python loop runs
over the active experts only (at most E per step, usually all of them for a prefill),
so a step costs 2 GEMMs per active expert whatever its token count.

The GEMMs are `F.linear`, but on a CPU whose oneDNN has no GEMM for the experts' 16-bit
dtype (AVX2 CPUs: `cpu_gemm.widens_half_dtype`) our AVX2 kernel, which reads each
expert's rows where they lie and widens them to float32 inside (`cpu_sgemm.linear_half`),
as the dense layers there do: torch's bf16 product on such a CPU converts the weight on
every call (a 32-request Qwen3-MoE run, 2026-12-06, Zen 3 VM: see docs/benchmarks.md).

Memory: the gathered rows [T*k, H], their gate/up products [T*k, 2I] and outputs
[T*k, H], plus the result [T, H]; nothing is kept between calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.layers import cpu_sgemm
from models.layers.cpu_gemm import widens_half_dtype


def sort_by_expert(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair order, local expert of each sorted pair, pairs per local expert [E_local]).

    A pair is one (token, k) slot of `topk_ids` [T, k], numbered t*k + j; pairs routed to
    another rank's expert (-1 in `expert_map`) are dropped. The order is stable, so the
    pairs of one expert keep their token order."""
    local_ids = topk_ids.reshape(-1)
    if expert_map is not None:
        local_ids = expert_map[local_ids]
    pairs = torch.arange(local_ids.numel(), device=local_ids.device)
    if expert_map is not None:
        kept = local_ids >= 0
        pairs, local_ids = pairs[kept], local_ids[kept]
    sorted_ids, order = torch.sort(local_ids, stable=True)
    counts = torch.bincount(sorted_ids, minlength=num_local_experts)
    return pairs[order], sorted_ids, counts


def expert_linear(w13: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The product the experts of `w13` [E_local, 2I, H] go through: `cpu_sgemm.linear_half`
    where the dense layers of the same dtype use it (the module docstring), else F.linear."""
    return cpu_sgemm.linear_half if w13.device.type == "cpu" and widens_half_dtype(w13.dtype) else F.linear


def grouped_fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j],
    over the pairs whose expert this rank holds: [T, H] in the input's dtype.

    `w13` [E_local, 2I, H] holds each expert's gate rows then its up rows, `w2`
    [E_local, H, I]; `expert_map` [E] maps global ids to local ones (-1: elsewhere),
    None when every expert is local. Under TP (sliced I) or EP the result is this
    rank's partial sum; the caller all-reduces it."""
    linear = expert_linear(w13)
    return grouped_experts(hidden_states, topk_weights, topk_ids, expert_map, w13.shape[0], w2.shape[2],
                           lambda e, rows: linear(rows, w13[e]), lambda e, act: linear(act, w2[e]))


def grouped_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_local_experts: int,
    intermediate: int,
    gate_up: Callable[[int, torch.Tensor], torch.Tensor],
    down: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`grouped_fused_experts` over experts given as products: `gate_up(e, rows)` ->
    [n, 2 * intermediate] (gate then up) and `down(e, act)` -> [n, H] for local expert
    e, in the rows' dtype (the quantised methods' own products, e.g. fp8 blocks)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden_states)
    if num_tokens == 0:
        return out
    pairs, _, counts = sort_by_expert(topk_ids, expert_map, num_local_experts)
    tokens = torch.div(pairs, top_k, rounding_mode="floor")
    rows = hidden_states.index_select(0, tokens)
    weights = topk_weights.reshape(-1).index_select(0, pairs)
    expert_out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts.tolist()):  # one host read of the counts
        if count == 0:
            continue
        seg = slice(start, start + count)
        gate_up_out = gate_up(expert, rows[seg])
        act = F.silu(gate_up_out[:, :intermediate]) * gate_up_out[:, intermediate:]
        # Weighted as it is stored, in the promoted dtype and rounded once into the rows:
        # the same values as weighting the whole [pairs, H] at the end, where that one
        # mixed-dtype product (and its float32 temporary) took 30 ms a layer of a 2048-token
        # bfloat16 prefill against 2.5 here (2026-12-06, the Zen 3 VM).
        torch.mul(down(expert, act), weights[seg].unsqueeze(1), out=expert_out[seg])
        start += count
    return out.index_add_(0, tokens, expert_out)
