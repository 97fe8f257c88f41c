"""The CUDA experts kernel: Triton GEMMs over token blocks sorted by expert.

Called by `FusedMoE.forward` on CUDA tensors (and by the tests on CPU tensors under
`TRITON_INTERPRET=1`), with the same arguments and result as
`grouped_moe.grouped_fused_experts`. The (token, k) pairs are sorted by expert and each
expert's run is padded to a multiple of BLOCK_M (`align_pairs_to_blocks`), so every
block of BLOCK_M sorted pairs belongs to one expert; nothing waits for the host, so a
decode step's MoE layers can be captured in a CUDA graph. One launch then computes, for all
blocks of all experts at once, the gate/up GEMM of each pair's token row with its
expert's w13; after the activation a second launch computes the down GEMM with w2 and
multiplies by the routed weight; the k rows of each token are summed at the end.

Memory: the block-padded pair list, the [T*k, 2I] and [T*k, I] intermediates and the
[T*k, H] outputs; nothing is kept between calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_pairs_ptr, block_expert_ptr,
    N, K, num_pairs, a_rows_per_pair_div,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[pair, n] = sum_k A[pair // div, k] * B[expert, n, k] (* weight[pair]) for the
    BLOCK_M pairs of block program_id(0), all routed to one expert; padding slots hold
    num_pairs and are masked out."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # A run's pairs come first in its blocks: an empty first slot means padding only.
    if tl.load(sorted_pairs_ptr + pid_m * BLOCK_M) >= num_pairs:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    pair_mask = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // a_rows_per_pair_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        # ieee: float32 weights keep float32 products (no TF32), as the CPU path does
        # (half-precision operands ignore it).
        acc += tl.dot(a, b, input_precision="ieee")
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * weight[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


def align_pairs_to_blocks(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pairs, each expert's run padded to a multiple of `block_m`
    [num_blocks*block_m], local expert of each block [num_blocks]); padding slots hold
    T*k (no pair). Pairs of another rank's experts are left out.

    No host synchronisation (CUDA graphs capture this): num_blocks is the bound
    cdiv(T*k + E_local*(block_m - 1), block_m) fixed by the shapes, and the blocks past
    the last expert's run hold only padding (the kernel skips them)."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    local_ids = topk_ids.reshape(-1)
    if expert_map is not None:
        # Other ranks' experts go to an extra bucket, sorted last and never stored.
        local_ids = torch.where(expert_map[local_ids] >= 0, expert_map[local_ids], num_local_experts)
    sorted_ids, pairs = torch.sort(local_ids, stable=True)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, sorted_ids, torch.ones_like(sorted_ids))
    start = torch.cumsum(counts, 0) - counts
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_local_experts] = 0
    padded_end = torch.cumsum(padded, 0)
    num_blocks = triton.cdiv(num_pairs + num_local_experts * (block_m - 1), block_m)
    num_slots = num_blocks * block_m
    # The i-th sorted pair's slot: its expert's padded start + its rank within the expert;
    # the extra bucket's pairs all land on one scratch slot past the end.
    slots = (padded_end - padded)[sorted_ids] + torch.arange(num_pairs, device=device) - start[sorted_ids]
    slots = torch.where(sorted_ids < num_local_experts, slots, num_slots)
    sorted_pairs = torch.full((num_slots + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, slots, pairs)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end[:num_local_experts], block_start, right=True)
    return sorted_pairs[:num_slots], block_expert.clamp_(max=num_local_experts - 1)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
            sorted_pairs: torch.Tensor, block_expert: torch.Tensor, a_rows_per_pair_div: int,
            mul_routed_weight: bool) -> None:
    num_blocks = block_expert.numel()
    n, k = b.shape[1], b.shape[2]
    grid = (num_blocks, triton.cdiv(n, BLOCK_N))
    _fused_moe_kernel[grid](
        a, b, c, topk_weights, sorted_pairs, block_expert,
        n, k, c.shape[0], a_rows_per_pair_div,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        MUL_ROUTED_WEIGHT=mul_routed_weight, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def triton_fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The contract of `grouped_fused_experts` ([T, H], this rank's partial sum), in two
    Triton launches. Pairs routed to another rank's expert stay zero."""
    num_tokens, top_k = topk_ids.shape
    hidden, intermediate = w2.shape[1], w2.shape[2]
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    sorted_pairs, block_expert = align_pairs_to_blocks(topk_ids, expert_map, w13.shape[0], BLOCK_M)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    # Zeros: the rows of pairs routed to other ranks' experts are never written.
    gate_up = torch.zeros(num_pairs, 2 * intermediate, dtype=hidden_states.dtype, device=hidden_states.device)
    _launch(hidden_states, w13, gate_up, weights, sorted_pairs, block_expert, top_k, False)
    act = (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]).contiguous()
    down = torch.zeros(num_pairs, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    _launch(act, w2, down, weights, sorted_pairs, block_expert, 1, True)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
