"""Automatic prefix caching: block hashing, sharing, LRU eviction, reset, and outputs.

The block-manager and scheduler tests run a fake runner that writes, into each KV
slot, a fingerprint of the whole prefix up to that position (what real K/V depends
on), and checks at every step that the context a request attends to holds exactly its
own prefix's fingerprints and that no two prefixes ever write one slot in a step.
The engine tests check greedy tokens with caching on against caching off and against
transformers, at TP 1 and 2.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from config import EngineConfig, SamplingParams
from engine.arg_utils import create_engine_config
from engine.block_hash import hash_block_tokens, prefix_cache_salt
from engine.block_manager import KVBlockManager
from engine.core import EngineCore
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.test_generation import _hf_model, hf_greedy
from worker.outputs import ModelRunnerOutput, SchedulerOutput

BS = 4
SALT = prefix_cache_salt("test-model")


def cached_manager(num_blocks: int = 16, block_size: int = BS) -> KVBlockManager:
    return KVBlockManager(num_blocks, block_size, enable_caching=True, hash_salt=SALT)


def make_request(req_id: str, tokens: list[int], **params: Any) -> Request:
    return Request(req_id, tokens, SamplingParams(**params))


def prefill(bm: KVBlockManager, request: Request) -> list[int]:
    """Admit `request` with whatever is cached, compute the rest of its prompt in one go
    and name its full blocks, as the scheduler does; returns the hit blocks."""
    hits = bm.get_computed_blocks(request)
    num_new = request.num_tokens - len(hits) * bm.block_size
    assert bm.allocate_slots(request, num_new, hits)
    assert request.num_computed_tokens == len(hits) * bm.block_size
    bm.cache_full_blocks(request, request.num_tokens)
    request.num_computed_tokens += num_new
    return hits


# ------------------------------------------------------------------ hashing


def test_block_hash_names_the_whole_prefix() -> None:
    a, b = [5, 6, 7, 8], [9, 10, 11, 12]
    assert hash_block_tokens(SALT, a) == hash_block_tokens(SALT, list(a))
    assert hash_block_tokens(SALT, a) != hash_block_tokens(prefix_cache_salt("other-model"), a)
    # The same second block after different first blocks is a different prefix.
    after_a = hash_block_tokens(hash_block_tokens(SALT, a), b)
    after_b = hash_block_tokens(hash_block_tokens(SALT, b), b)
    assert after_a != after_b
    assert len(after_a) == 32  # SHA-256


# ------------------------------------------------------------ block manager


def test_repeated_prompt_reuses_every_full_block_but_computes_the_last_token() -> None:
    bm = cached_manager()
    first = make_request("a", list(range(100, 112)))  # exactly 3 blocks
    assert prefill(bm, first) == []
    again = make_request("b", list(range(100, 112)))
    # 3 full blocks are cached, but the last token must run to give logits: 2 hits.
    assert prefill(bm, again) == first.block_ids[:2]
    assert again.block_ids[2] != first.block_ids[2]
    longer = make_request("c", list(range(100, 113)))
    assert prefill(bm, longer) == first.block_ids[:3]


def test_only_whole_blocks_are_shared() -> None:
    bm = cached_manager()
    first = make_request("a", list(range(100, 106)))  # one full block and a partial one
    prefill(bm, first)
    second = make_request("b", list(range(100, 106)) + [7, 8, 9])
    assert prefill(bm, second) == first.block_ids[:1]
    other = make_request("c", [1] + list(range(101, 110)))  # differs in the first token
    assert prefill(bm, other) == []


def test_shared_blocks_are_counted_and_released_by_the_last_holder() -> None:
    bm = cached_manager(num_blocks=8)
    a = make_request("a", list(range(100, 109)))
    b = make_request("b", list(range(100, 109)))
    prefill(bm, a)
    prefill(bm, b)
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared
    assert [bm.ref_counts[x] for x in shared] == [2, 2]
    assert bm.num_free_blocks == 8 - 4  # a: 3 blocks, b: 2 shared + 1 own
    bm.free(a)
    assert [bm.ref_counts[x] for x in shared] == [1, 1]
    assert bm.num_free_blocks == 8 - 3
    bm.free(b)
    assert bm.ref_counts == (0,) * 8
    assert bm.num_free_blocks == 8
    assert bm.num_cached_blocks == 2  # freed, but still cached


def test_eviction_is_lru_and_tail_first_and_spares_blocks_in_use() -> None:
    bm = cached_manager(num_blocks=6)
    a = make_request("a", list(range(100, 109)))  # blocks: 2 full (named) + 1 partial
    b = make_request("b", list(range(200, 209)))
    prefill(bm, a)
    a_named = a.block_ids[:2]
    bm.free(a)
    prefill(bm, b)
    b_named = b.block_ids[:2]
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    # Needs 4 blocks: the 2 never-named free ones first, then a's two, tail first.
    c = make_request("c", list(range(300, 316)))
    prefill(bm, c)
    assert bm.stats.evictions == 2
    assert set(c.block_ids) >= set(a_named)
    assert c.block_ids.index(a_named[1]) < c.block_ids.index(a_named[0])
    assert bm.get_computed_blocks(make_request("a2", list(range(100, 109)))) == []
    assert bm.get_computed_blocks(make_request("b2", list(range(200, 209)))) == b_named
    # c holds 4 blocks and b's 2 are evictable: a 3-block request may evict them, a
    # 7-block one may not take c's.
    assert not bm.allocate_slots(make_request("d", list(range(400, 428))), 28)
    assert all(bm.ref_counts[x] == 1 for x in c.block_ids)


def test_taking_a_cached_free_block_as_a_hit_uses_up_free_space() -> None:
    bm = cached_manager(num_blocks=3)
    a = make_request("a", list(range(100, 109)))  # 3 blocks, 2 named
    prefill(bm, a)
    bm.free(a)
    # b hits a's 2 named blocks (no longer free) and needs 2 more: only 1 is left.
    b = make_request("b", list(range(100, 108)) + list(range(500, 508)))
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert not bm.allocate_slots(b, 8, hits)
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert bm.ref_counts == (0, 0, 0) and bm.num_free_blocks == 3


def test_reset_prefix_cache_forgets_every_block() -> None:
    bm = cached_manager(num_blocks=8)
    a = make_request("a", list(range(100, 113)))
    prefill(bm, a)
    running = make_request("r", list(range(200, 209)))
    prefill(bm, running)
    bm.free(a)
    assert bm.reset_prefix_cache() == 5
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8 - 3
    assert bm.get_computed_blocks(make_request("a2", list(range(100, 113)))) == []
    bm.free(running)
    assert bm.num_free_blocks == 8 and bm.ref_counts == (0,) * 8


def test_caching_off_never_shares() -> None:
    bm = KVBlockManager(8, BS)
    a = make_request("a", list(range(100, 109)))
    prefill(bm, a)
    assert bm.get_computed_blocks(make_request("b", list(range(100, 109)))) == []
    assert bm.num_cached_blocks == 0


# --------------------------------------------------------------- scheduler


class FingerprintRunner:
    """A fake runner whose "K/V" in each slot is the prefix it was computed from.

    Like a real attention backend, it writes the whole step's K/V before any sequence
    reads its context; a slot, once written, must never change its content while a
    request still reads it (checked by every later read)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        size = self.scheduler.block_manager.block_size
        written: dict[int, tuple[int, ...]] = {}
        for s in out.scheduled:
            all_tokens = self.scheduler.requests[s.req_id].all_token_ids
            for pos in range(s.start_pos, s.start_pos + len(s.token_ids)):
                slot = s.block_ids[pos // size] * size + pos % size
                fingerprint = tuple(all_tokens[: pos + 1])
                assert written.setdefault(slot, fingerprint) == fingerprint, f"two prefixes write slot {slot}"
                self.slots[slot] = fingerprint
        req_ids, tokens = [], []
        for s in out.scheduled:
            all_tokens = self.scheduler.requests[s.req_id].all_token_ids
            for pos in range(s.start_pos + len(s.token_ids)):  # the whole context it attends to
                slot = s.block_ids[pos // size] * size + pos % size
                assert self.slots.get(slot) == tuple(all_tokens[: pos + 1]), (s.req_id, pos)
            if s.sample:
                req_ids.append(s.req_id)
                # The next token depends only on the prefix, like greedy decoding.
                tokens.append(10 + hash(tuple(all_tokens)) % 40)
        return ModelRunnerOutput(req_ids, tokens, [None] * len(req_ids))

    def step(self) -> list[Request]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        return self.scheduler.update_from_output(out, self.execute(out))


def make_scheduler(num_blocks: int, enable_caching: bool = True, **kwargs: Any) -> Scheduler:
    return Scheduler(
        max_num_seqs=kwargs.get("max_num_seqs", 6),
        max_num_batched_tokens=kwargs.get("max_num_batched_tokens", 24),
        max_model_len=128,
        block_manager=KVBlockManager(num_blocks, BS, enable_caching=enable_caching, hash_salt=SALT),
        eos_token_id=None,
    )


def test_a_request_reuses_the_full_blocks_of_one_still_running() -> None:
    sched = make_scheduler(num_blocks=32)
    runner = FingerprintRunner(sched)
    prefix = list(range(100, 114))  # 3 full blocks and 2 tokens
    sched.add_request(make_request("a", prefix, max_tokens=8, ignore_eos=True))
    runner.step()  # a's prefill
    runner.step()  # a decodes
    sched.add_request(make_request("b", prefix[:13] + [7, 7, 7], max_tokens=4, ignore_eos=True))
    out = sched.schedule()
    (b,) = [s for s in out.scheduled if s.req_id == "b"]
    a = sched.requests["a"]
    assert b.start_pos == 12 and b.token_ids == [prefix[12], 7, 7, 7]
    assert b.block_ids[:3] == a.block_ids[:3]
    assert sched.block_manager.stats.queries == 14 + 16
    assert sched.block_manager.stats.hits == 12
    sched.update_from_output(out, runner.execute(out))


def test_requests_admitted_in_one_step_share_the_blocks_being_computed() -> None:
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=24)
    runner = FingerprintRunner(sched)
    prefix = list(range(100, 114))  # 3 full blocks and 2 tokens
    sched.add_request(make_request("a", prefix, max_tokens=2, ignore_eos=True))
    sched.add_request(make_request("b", prefix + [7, 7], max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    a, b = out.scheduled
    assert (a.start_pos, len(a.token_ids)) == (0, 14)
    assert (b.start_pos, len(b.token_ids)) == (12, 4)  # fits the 10 tokens left of the budget
    assert b.block_ids[:3] == a.block_ids[:3]
    sched.update_from_output(out, runner.execute(out))
    while sched.has_unfinished_requests():
        runner.step()
    assert sched.block_manager.ref_counts == (0,) * 32


def _mixed_run(enable_caching: bool, seed: int) -> tuple[dict[str, list[int]], Scheduler, int]:
    """Requests from three shared prefixes under a tight cache, with aborts; returns
    the finished requests' outputs, the scheduler and the number of preemptions."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 400) for _ in range(rng.randrange(5, 21))] for _ in range(3)]
    sched = make_scheduler(num_blocks=20, enable_caching=enable_caching)
    runner = FingerprintRunner(sched)
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    every: list[Request] = []
    for step in range(400):
        if step < 60 and step % 2 == 0:
            tokens = rng.choice(prefixes) + [rng.randrange(100, 400) for _ in range(rng.randrange(0, 9))]
            request = make_request(f"r{step}", tokens, max_tokens=rng.randrange(1, 30), ignore_eos=True)
            sched.add_request(request)
            every.append(request)
        if step % 13 == 5 and sched.running:
            victim = sched.running[rng.randrange(len(sched.running))]
            sched.abort_request(victim.request_id)
            aborted.add(victim.request_id)
        for request in runner.step():
            if request.is_finished():
                outputs[request.request_id] = list(request.output_token_ids)
        if step >= 60 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert set(outputs) | aborted == {r.request_id for r in every}
    assert all(r.status != RequestStatus.RUNNING for r in every)
    return outputs, sched, sum(r.num_preemptions for r in every)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_run_with_aborts_and_preemptions_returns_every_block(seed: int) -> None:
    outputs, sched, preemptions = _mixed_run(enable_caching=True, seed=seed)
    bm = sched.block_manager
    assert preemptions > 0, "the budget should force preemptions"
    assert bm.stats.hits > 0 and bm.stats.evictions > 0
    assert bm.ref_counts == (0,) * bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks
    # Aborts pick from the running batch, which caching changes; compare the requests
    # both runs finished.
    reference, _, _ = _mixed_run(enable_caching=False, seed=seed)
    both = set(outputs) & set(reference)
    assert len(both) >= 10
    assert {r: outputs[r] for r in both} == {r: reference[r] for r in both}


# ----------------------------------------------------------------- engines

MAX_NEW = 8


def engine_config(model_dir: Path, tp: int, enable_prefix_caching: bool, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), tensor_parallel_size=tp, device="cpu", dtype="float32", max_model_len=128,
        max_num_seqs=8, max_num_batched_tokens=64, block_size=BS, num_gpu_blocks_override=128,
        enable_prefix_caching=enable_prefix_caching,
    )
    kwargs.update(overrides)
    return create_engine_config(**kwargs)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _cases() -> tuple[list[int], list[tuple[str, list[int], int]]]:
    """The first prompt, then (case, prompt, expected cached tokens) run after it."""
    rng = random.Random(7)
    base = [rng.randrange(4, 320) for _ in range(23)]  # 5 full blocks and 3 tokens
    fresh = [rng.randrange(4, 320) for _ in range(20)]
    return base, [
        ("repeated prompt", list(base), 20),
        ("one block", base[:BS] + fresh[:9], BS),
        ("blocks and a partial block", base[: 3 * BS + 3] + fresh[:5], 3 * BS),
        ("the whole prompt", base + fresh[:6], 20),
    ]


@pytest.fixture(scope="module")
def hf_llama(tiny_models: dict[str, Path]) -> Any:
    return _hf_model(tiny_models["llama"])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_outputs_equal_with_caching_on_and_off_and_transformers(
    tp: int, tiny_models: dict[str, Path], hf_llama: Any
) -> None:
    base, cases = _cases()
    results: dict[bool, list[list[int]]] = {}
    for caching in (True, False):
        with EngineCore(engine_config(tiny_models["llama"], tp, caching)) as core:
            stats = core.scheduler.block_manager.stats
            outs = [core.generate(base, greedy())[0].token_ids]
            for case, prompt, expected_hits in cases:
                before = stats.hits
                outs.append(core.generate(prompt, greedy())[0].token_ids)
                assert stats.hits - before == (expected_hits if caching else 0), case
            # Both at once: the second shares the blocks the first computes in the same step.
            outs += [o.token_ids for o in core.generate([base + [9, 9], base + [9, 9]], greedy())]
            results[caching] = outs
    assert results[True] == results[False]
    prompts = [base] + [p for _, p, _ in cases] + [base + [9, 9]] * 2
    for prompt, tokens in zip(prompts, results[True]):
        assert tokens == hf_greedy(hf_llama, prompt, MAX_NEW)[0]


def test_follow_up_turn_reuses_the_blocks_of_generated_tokens(tiny_models: dict[str, Path], hf_llama: Any) -> None:
    base, _ = _cases()
    with EngineCore(engine_config(tiny_models["llama"], 1, True)) as core:
        first = core.generate(base, greedy())[0].token_ids
        follow_up = base + first + [11, 12, 13]
        stats = core.scheduler.block_manager.stats
        before = stats.hits
        out = core.generate(follow_up, greedy())[0].token_ids
        # The last generated token never ran through the model, so its K/V is not cached.
        assert stats.hits - before == (len(base) + len(first) - 1) // BS * BS
        assert out == hf_greedy(hf_llama, follow_up, MAX_NEW)[0]


def test_eviction_under_a_small_cache_keeps_outputs_right(tiny_models: dict[str, Path]) -> None:
    rng = random.Random(3)
    prefixes = [[rng.randrange(4, 320) for _ in range(18)] for _ in range(4)]
    prompts = [rng.choice(prefixes) + [rng.randrange(4, 320) for _ in range(rng.randrange(1, 6))] for _ in range(16)]
    outputs = {}
    for caching in (True, False):
        # 40 blocks of 4: room for a few requests at a time, not for every prefix.
        with EngineCore(engine_config(tiny_models["llama"], 1, caching, num_gpu_blocks_override=40)) as core:
            got = [o.token_ids for o in core.generate(prompts[:8], greedy())]
            got += [core.generate(p, greedy())[0].token_ids for p in prompts[8:]]
            outputs[caching] = got
            bm = core.scheduler.block_manager
            if caching:
                assert bm.stats.hits > 0 and bm.stats.evictions > 0
            assert bm.ref_counts == (0,) * bm.num_blocks and bm.num_free_blocks == bm.num_blocks
    assert outputs[True] == outputs[False]


def test_engine_reset_prefix_cache(tiny_models: dict[str, Path]) -> None:
    base, _ = _cases()
    with EngineCore(engine_config(tiny_models["llama"], 1, True)) as core:
        first = core.generate(base, greedy())[0].token_ids
        stats = core.scheduler.block_manager.stats
        assert core.reset_prefix_cache() > 0
        hits = stats.hits
        assert core.generate(base, greedy())[0].token_ids == first
        assert stats.hits == hits
        assert core.scheduler.block_manager.num_cached_blocks > 0  # cached again


def test_prefix_caching_is_on_by_default_and_can_be_turned_off(tiny_models: dict[str, Path]) -> None:
    assert create_engine_config(model=str(tiny_models["llama"]), device="cpu").cache_config.enable_prefix_caching
    off = create_engine_config(model=str(tiny_models["llama"]), device="cpu", enable_prefix_caching=False)
    assert not off.cache_config.enable_prefix_caching
    from engine.entrypoints.cli_args import build_parser

    assert build_parser().parse_args(["m"]).enable_prefix_caching
    assert not build_parser().parse_args(["m", "--no-enable-prefix-caching"]).enable_prefix_caching
