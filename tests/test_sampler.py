"""Sampler: greedy, seeded reproducibility, top-k/top-p filtering, logprobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import SamplingParams
from worker.outputs import ScheduledRequest
from worker.sampler import Sampler, request_step_seed, stable_hash

VOCAB = 50


def sreq(req_id: str, num_output_tokens: int = 0, **params: object) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        token_ids=[1],
        start_pos=0,
        block_ids=[0],
        sample=True,
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        num_output_tokens=num_output_tokens,
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(4)
    reqs = [sreq(f"r{i}", temperature=0.0) for i in range(4)]
    tokens, logprobs = Sampler()(logits, reqs)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 4


def test_top_k_one_is_greedy_even_at_high_temperature() -> None:
    logits = random_logits(3, seed=1)
    reqs = [sreq(f"r{i}", temperature=5.0, top_k=1) for i in range(3)]
    assert Sampler()(logits, reqs)[0] == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy() -> None:
    logits = random_logits(3, seed=2)
    sampler = Sampler()
    for step in range(10):
        reqs = [sreq(f"r{i}", step, temperature=1.0, top_p=1e-6) for i in range(3)]
        assert sampler(logits, reqs)[0] == logits.argmax(dim=-1).tolist()


def test_seeded_sampling_is_reproducible() -> None:
    logits = random_logits(1, seed=3)
    sampler = Sampler()
    draws = [sampler(logits, [sreq("x", step, seed=7)])[0][0] for step in range(30)]
    again = [sampler(logits, [sreq("x", step, seed=7)])[0][0] for step in range(30)]
    assert draws == again
    assert len(set(draws)) > 1  # it really samples


def test_sampling_is_independent_of_batch_composition() -> None:
    logits = random_logits(1, seed=4)
    sampler = Sampler()
    target = sreq("target", 5, seed=11, top_k=20, top_p=0.9, temperature=0.8)
    alone = sampler(logits, [target])[0][0]
    others = random_logits(3, seed=5)
    for position in range(4):
        rows = list(others)
        rows.insert(position, logits[0])
        batch = [sreq(f"o{i}", i, temperature=1.0) for i in range(3)]
        batch.insert(position, target)
        tokens, _ = sampler(torch.stack(rows), batch)
        assert tokens[position] == alone


def test_unseeded_requests_use_engine_seed_and_request_id() -> None:
    logits = random_logits(1, seed=6)
    sampler = Sampler()

    def draws(req_id: str, engine_seed: int) -> list[int]:
        return [sampler(logits, [sreq(req_id, s)], engine_seed)[0][0] for s in range(20)]

    assert draws("a", 0) == draws("a", 0)
    assert draws("a", 0) != draws("b", 0)
    assert draws("a", 0) != draws("a", 1)


@pytest.mark.slow
def test_stable_hash_is_stable_across_processes() -> None:
    code = "from worker.sampler import stable_hash; print(stable_hash('req-1', 5, -3))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
            cwd=Path(__file__).resolve().parents[1],
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert outputs == {str(stable_hash("req-1", 5, -3))}
    assert 0 <= request_step_seed(sreq("a", 3)) < 2**63


def test_top_k_restricts_support() -> None:
    logits = random_logits(1, seed=7)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    sampler = Sampler()
    seen = {sampler(logits, [sreq("k", s, top_k=3, temperature=10.0)])[0][0] for s in range(200)}
    assert seen <= allowed
    assert len(seen) > 1


def test_top_p_restricts_support_to_nucleus() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two only.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler()
    seen = {sampler(logits, [sreq("p", s, top_p=0.7)])[0][0] for s in range(300)}
    assert seen == {0, 1}
    # top_p=0.85: the first two hold only 0.8, so the third joins the nucleus.
    seen = {sampler(logits, [sreq("p", s, top_p=0.85)])[0][0] for s in range(300)}
    assert seen == {0, 1, 2}


@pytest.mark.slow
def test_draws_follow_the_distribution() -> None:
    """Over many steps each token is drawn about as often as its probability says (within
    4.5 standard deviations of a binomial count), and a token of zero mass never is:
    the draw itself, whatever filters ran before it."""
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]])
    logits = probs.log()  # the last is -inf
    sampler = Sampler()
    draws = 6000
    counts = torch.zeros(5)
    for step in range(draws):
        counts[sampler(logits, [sreq("d", step, temperature=1.0)])[0][0]] += 1
    assert counts[4] == 0
    for p, count in zip(probs[0].tolist()[:4], counts.tolist()[:4]):
        sigma = (draws * p * (1 - p)) ** 0.5
        assert abs(count - draws * p) <= 4.5 * sigma, (p, count / draws)


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(2, seed=8)
    reqs = [
        sreq("a", temperature=0.0, logprobs=3),
        sreq("b", 2, temperature=0.5, top_k=5, seed=1, logprobs=0),
    ]
    tokens, logprobs = Sampler()(logits, reqs)
    expected = torch.log_softmax(logits, dim=-1)
    lp_a, lp_b = logprobs
    assert lp_a is not None and lp_b is not None
    top3 = torch.topk(expected[0], 3).indices.tolist()
    assert set(lp_a) == set(top3) | {tokens[0]}
    for tok, value in lp_a.items():
        assert value == pytest.approx(expected[0, tok].item(), abs=1e-6)
    # logprobs=0: only the sampled token, unaffected by temperature / top-k.
    assert set(lp_b) == {tokens[1]}
    assert lp_b[tokens[1]] == pytest.approx(expected[1, tokens[1]].item(), abs=1e-6)


def test_logprobs_include_sampled_token_outside_top_k() -> None:
    # Uniform logits: with logprobs=1 the top-1 id is fixed (0) but the drawn
    # token varies; the drawn one must always be reported too.
    flat = torch.zeros(1, 8)
    sampler = Sampler()
    drawn = set()
    for step in range(50):
        tokens, logprobs = sampler(flat, [sreq("f", step, logprobs=1)])
        lp = logprobs[0]
        assert lp is not None and tokens[0] in lp and len(lp) <= 2
        assert all(v == pytest.approx(-torch.log(torch.tensor(8.0)).item()) for v in lp.values())
        drawn.add(tokens[0])
    assert len(drawn - {0}) > 0


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="num_requests=2"):
        Sampler()(torch.zeros(1, VOCAB), [sreq("a"), sreq("b")])


def test_argmax_suffices_only_for_plain_greedy_rows_with_nothing_else_to_compute() -> None:
    """The runner skips the sampler (and, at TP > 1, the logits all-gather) only when every
    token is the raw argmax: a batch with any row that samples, processes its logits,
    wants logprobs or has a token history kept here needs the whole logits."""
    sampler = Sampler()
    greedy = [sreq("a", temperature=0.0), sreq("b", temperature=0.7, top_k=1)]
    assert sampler.argmax_suffices(greedy)
    for other in (sreq("c", temperature=0.7), sreq("c", temperature=0.0, logprobs=0),
                  sreq("c", temperature=0.0, repetition_penalty=1.2), sreq("c", temperature=0.0, min_tokens=3),
                  sreq("c", temperature=0.0, logit_bias={3: 1.0}), sreq("c", temperature=0.0, allowed_token_ids=[1, 2])):
        assert not sampler.argmax_suffices([*greedy, other]), other.sampling_params
    sampler.add_history("a", [1, 2], [])  # e.g. prompt_logprobs: the sampler keeps its tokens
    assert not sampler.argmax_suffices(greedy)
    sampler.drop(["a"])
    assert sampler.argmax_suffices(greedy)
