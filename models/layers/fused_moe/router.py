"""The router's top-k: which experts each token goes to, and with what weight.

Called by `FusedMoE.forward` on every rank with the same router logits (the gate is
replicated), so every rank picks the same experts for every token. Both families take
the softmax over all experts in float32 and keep the top k; Mixtral then always
renormalises the k weights to sum to 1 (the same as a softmax over the k logits),
Qwen3-MoE only when `norm_topk_prob` is set.

On the CPU one C call (`topk_softmax.c`, vLLM's topk_softmax) does all of it, where
torch's four ops cost a decode step more in dispatch than in arithmetic; elsewhere (CUDA,
or where the kernel cannot be built) the torch ops. The two agree up to the last place of
their exp (glibc's expf against torch's vectorised one), so a near-tie of two experts'
probabilities could be broken differently; every rank runs the same path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from distributed.native_build import BF16_CONVERT_H, FP16_CONVERT_H, load_kernel
from distributed.native_calls import NativeLibrary

SOURCES = (Path(__file__).with_name("topk_softmax.c"), BF16_CONVERT_H, FP16_CONVERT_H)
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBS = ("-lm",)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # topk_softmax.c's dtype
MAX_EXPERTS = 1024  # topk_softmax.c's: a row's probabilities on the stack


class TopkSoftmaxKernel:
    """The loaded library's `topk_softmax`."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path = path
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._topk = lib.topk_softmax
        self._topk.restype = ctypes.c_int
        self._topk.argtypes = [p, i32, i64, i64, i64, i64, i32, p, p, i32]

    def topk(self, router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`fused_topk` of 2-D CPU logits (a `_DTYPES` dtype, unit stride along experts)."""
        tokens, experts = router_logits.shape
        weights = torch.empty(tokens, top_k, dtype=torch.float32)
        ids = torch.empty(tokens, top_k, dtype=torch.int64)
        status = self._topk(router_logits.data_ptr(), _DTYPES[router_logits.dtype], router_logits.stride(0), tokens,
                            experts, top_k, int(renormalize), weights.data_ptr(), ids.data_ptr(),
                            torch.get_num_threads())
        if status:
            raise RuntimeError(f"topk_softmax returned {status} for top_k={top_k}, {experts} experts")
        return weights, ids


@functools.cache
def load() -> TopkSoftmaxKernel | None:
    """The kernel, built if this machine has none cached; None where it cannot be built
    (logged once): the torch ops then."""
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBS, TopkSoftmaxKernel,
                       "CPU top-k kernel unavailable (%s); the router's top-k runs in torch")


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] float32, topk_ids [T, k] int64) for `router_logits` [T, E].

    Ties between equal probabilities go to the lower expert id on the CPU kernel's path
    (torch.topk, like transformers, breaks them in no stated order). Raises ValueError
    when k is not in [1, E]."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
    if (router_logits.device.type == "cpu" and router_logits.dim() == 2 and router_logits.dtype in _DTYPES
            and router_logits.stride(1) == 1 and num_experts <= MAX_EXPERTS and (kernel := load()) is not None):
        return kernel.topk(router_logits, top_k, renormalize)
    return torch_topk(router_logits, top_k, renormalize)


def torch_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_topk` in torch ops (CUDA; the CPU without the kernel; the tests' reference)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
