"""The router's top-k: which experts each token goes to, and with what weight.

Called by `FusedMoE.forward` on every rank with the same router logits (the gate is
replicated), so every rank picks the same experts for every token. Both families take
the softmax over all experts in float32 and keep the top k; Mixtral then always
renormalises the k weights to sum to 1 (the same as a softmax over the k logits),
Qwen3-MoE only when `norm_topk_prob` is set.
"""

from __future__ import annotations

import torch


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] float32, topk_ids [T, k] int64) for `router_logits` [T, E].

    Ties between equal probabilities go to the lower expert id (torch.topk's order), as
    in transformers. Raises ValueError when k is not in [1, E]."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
