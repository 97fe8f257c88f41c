"""The router's top-k on the CPU (`fused_moe/topk_softmax.c`) against the torch ops it
replaces (`router.torch_topk`): the same experts and, up to the last places of the
exp, the same weights, for every logits dtype, with and without renormalising; the
kernel's own tie rule (the lower expert id) and edge rows; thread-count independence;
and a CPU graph recording the one call."""

from __future__ import annotations

import pytest
import torch

from models.layers.fused_moe import router
from models.layers.fused_moe.router import fused_topk, torch_topk
from worker.cpu_graph import record

# (tokens, experts, top_k): one decode token of Qwen3-MoE's shape at a small width, a
# Mixtral-like 8-choose-2 batch, a 128-expert decode batch, k == E, k == 1.
SHAPES = [(1, 16, 4), (37, 8, 2), (64, 128, 8), (5, 6, 6), (300, 64, 1)]


pytestmark = pytest.mark.skipif(router.load() is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_torch_on_float32_logits(shape: tuple[int, int, int], renormalize: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, experts, k = shape
    logits = 4 * torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens + experts))
    want_weights, want_ids = torch_topk(logits, k, renormalize)
    # the kernel, not the torch ops, on the CPU
    monkeypatch.setattr(router.torch, "softmax", lambda *a, **kw: pytest.fail("torch.softmax called"))
    weights, ids = fused_topk(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (tokens, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_logits_pick_the_same_probabilities(dtype: torch.dtype) -> None:
    """16-bit logits tie often (equal values, equal probabilities): torch.topk breaks ties
    in no stated order, the kernel by the lower id, so the chosen probabilities (not
    always the ids) must agree, and where the ids differ their probabilities tie."""
    logits = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights, ids = fused_topk(logits, 8, renormalize=False)
    want_weights, want_ids = torch_topk(logits, 8, renormalize=False)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    differ = ids != want_ids
    assert differ.any(), "no ties met: the case no longer checks the tie rule"
    torch.testing.assert_close(probs.gather(1, ids)[differ], probs.gather(1, want_ids)[differ], rtol=2e-6, atol=0)
    assert torch.equal(ids.sort(1).values[~differ.any(1)], want_ids.sort(1).values[~differ.any(1)])


def test_ties_edges_and_refusals() -> None:
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[1.0, 3.0, 3.0, 1.0, 3.0],     # ties: the lower ids, in id order
                           [-inf, 0.5, -inf, 0.0, -inf],  # masked experts never chosen
                           [0.0, nan, 1.0, 2.0, 0.0]])    # a NaN: every probability NaN
    weights, ids = fused_topk(logits, 2, renormalize=True)
    assert ids[0].tolist() == [1, 2] and ids[1].tolist() == [1, 3]
    torch.testing.assert_close(weights[0], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(weights[1], torch.softmax(torch.tensor([0.5, 0.0]), 0))
    assert weights[2].isnan().all() and len(set(ids[2].tolist())) == 2 and ids[2].min() >= 0 and ids[2].max() < 5
    weights, ids = fused_topk(logits[:1], 5, renormalize=False)  # k == E: every expert, by probability
    assert ids.tolist() == [[1, 2, 4, 0, 3]]
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="num_experts_per_tok=6"):
        fused_topk(logits, 6, renormalize=True)
    # a strided view (a slice of wider logits) reads its own rows
    wide = torch.randn(7, 12, generator=torch.Generator().manual_seed(2))
    weights, ids = fused_topk(wide[:, :6], 2, renormalize=True)
    want_weights, want_ids = torch_topk(wide[:, :6].contiguous(), 2, renormalize=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=0)


def test_results_do_not_depend_on_threads() -> None:
    logits = torch.randn(2048, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_topk(logits, 8, renormalize=True)
        torch.set_num_threads(max(2, threads))
        many = fused_topk(logits, 8, renormalize=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_recorded_as_one_call_in_a_cpu_graph() -> None:
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))

    def route() -> torch.Tensor:
        weights, ids = fused_topk(logits * 1.0, 4, renormalize=True)
        return weights * ids  # one output tensor that depends on both

    with torch.inference_mode():
        _, graph = record(route)
        assert len(graph.steps) == 3  # the scale, the kernel, the product: no softmax, topk, sum or division
        for seed in (5, 6):
            logits.copy_(torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)))
            torch.testing.assert_close(graph.replay(), route(), rtol=0, atol=0)
