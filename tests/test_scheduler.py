"""Scheduler behaviour against a deterministic fake model runner.

The fake runner "samples" token ``expected[req_id][num_output_tokens]``, so a
request's output depends only on how many tokens it already has — exactly the
property the real seeded sampler guarantees. It also mirrors a real runner's
per-request state (dropped on ``finished_req_ids``) and checks every step's
invariants.
"""

from __future__ import annotations

import pickle
import random

import pytest

from config import SamplingParams
from engine.block_manager import KVBlockManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from worker.outputs import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    num_blocks: int = 64,
    block_size: int = 4,
    eos_token_id: int | None = EOS,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    return Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_manager=KVBlockManager(num_blocks, block_size),
        eos_token_id=eos_token_id,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )


def make_request(req_id: str, num_prompt: int, **params: object) -> Request:
    # Prompt tokens start at 100 so they never collide with EOS/stop ids.
    prompt = [100 + (hash_id(req_id) + i) % 50 for i in range(num_prompt)]
    return Request(req_id, prompt, SamplingParams(**params))  # type: ignore[arg-type]


def hash_id(req_id: str) -> int:
    return sum(map(ord, req_id))


def default_tokens(req_id: str, n: int = 200) -> list[int]:
    """A fixed per-request output sequence without EOS (ids 10..49)."""
    return [10 + (hash_id(req_id) * 7 + 3 * k) % 40 for k in range(n)]


class FakeRunner:
    """Deterministic stand-in for the model runner that also checks invariants."""

    def __init__(self, scheduler: Scheduler, expected: dict[str, list[int]] | None = None):
        self.scheduler = scheduler
        self.expected = expected or {}
        self.computed: dict[str, int] = {}  # runner-side state, like a real KV table
        self.params: dict[str, SamplingParams] = {}  # sent once per admission, kept till finished
        self.steps: list[SchedulerOutput] = []

    def tokens_for(self, req_id: str) -> list[int]:
        return self.expected.get(req_id) or default_tokens(req_id)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sched = self.scheduler
        self.steps.append(out)
        # Per-step bounds.
        assert len(out.scheduled) <= sched.max_num_seqs
        assert 0 < out.num_batched_tokens <= sched.max_num_batched_tokens
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled)
        assert len({s.req_id for s in out.scheduled}) == len(out.scheduled)
        for req_id in out.finished_req_ids:
            self.computed.pop(req_id, None)
            self.params.pop(req_id, None)
        used_blocks: list[int] = []
        req_ids, tokens, logprobs = [], [], []
        for s in out.scheduled:
            req = sched.requests[s.req_id]
            # Params come with the step that (re-)admits a request, from position 0 of
            # whatever its cache lacks, and never again until it finished or was preempted.
            if s.sampling_params is not None:
                assert s.req_id not in self.params, f"{s.req_id}: params sent twice"
                assert s.sampling_params is req.sampling_params
                self.params[s.req_id] = s.sampling_params
            else:
                assert s.req_id in self.params, f"{s.req_id}: scheduled before its params were sent"
            # The chunk continues exactly where the runner's KV ends.
            assert s.start_pos == self.computed.get(s.req_id, 0)
            assert s.token_ids == req.all_token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
            assert len(s.token_ids) >= 1
            end = s.start_pos + len(s.token_ids)
            assert s.sample == (end == req.num_tokens)
            assert len(s.block_ids) * sched.block_manager.block_size >= end
            assert s.num_output_tokens == req.num_output_tokens
            used_blocks += s.block_ids
            self.computed[s.req_id] = end
            if s.sample:
                token = self.tokens_for(s.req_id)[s.num_output_tokens]
                req_ids.append(s.req_id)
                tokens.append(token)
                logprobs.append(
                    {token: -0.5} if self.params[s.req_id].logprobs is not None else None
                )
        assert len(used_blocks) == len(set(used_blocks)), "a block is shared"
        return ModelRunnerOutput(req_ids, tokens, logprobs)

    def step(self) -> list[Request]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        return self.scheduler.update_from_output(out, self.execute(out))

    def run(self, max_steps: int = 10_000) -> list[Request]:
        finished: list[Request] = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return finished
            finished += [r for r in self.step() if r.is_finished()]
        raise AssertionError("scheduler did not drain")


# --------------------------------------------------------------------- basics


def test_single_request_prefill_then_decode() -> None:
    sched = make_scheduler()
    req = make_request("a", 5, max_tokens=3)
    sched.add_request(req)
    runner = FakeRunner(sched)
    finished = runner.run()
    assert finished == [req]
    assert req.output_token_ids == default_tokens("a")[:3]
    assert req.finish_reason == "length" and req.status == RequestStatus.FINISHED_LENGTH
    first, *decodes = runner.steps
    assert first.scheduled[0].token_ids == req.prompt_token_ids
    assert first.scheduled[0].sample
    assert [len(s.scheduled[0].token_ids) for s in decodes] == [1, 1]
    assert [s.scheduled[0].start_pos for s in decodes] == [5, 6]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert not sched.has_unfinished_requests()


def test_fcfs_order_with_one_slot() -> None:
    sched = make_scheduler(max_num_seqs=1)
    reqs = [make_request(name, 3, max_tokens=2) for name in "abc"]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    finished = runner.run()
    assert [r.request_id for r in finished] == ["a", "b", "c"]
    order = [s.scheduled[0].req_id for s in runner.steps]
    assert order == ["a", "a", "b", "b", "c", "c"]
    assert [r.arrival_index for r in reqs] == [0, 1, 2]


def test_waiting_requests_admitted_in_arrival_order() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=100)
    for name in "abcde":
        sched.add_request(make_request(name, 4, max_tokens=5))
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["a", "b", "c"]


def test_bounds_hold_every_step_under_random_load() -> None:
    rng = random.Random(0)
    sched = make_scheduler(
        max_num_seqs=4, max_num_batched_tokens=16, num_blocks=40, block_size=4, max_model_len=64
    )
    reqs = [
        make_request(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 12))
        for i in range(20)
    ]
    runner = FakeRunner(sched)
    pending = list(reqs)
    for _ in range(2000):
        # Trickle requests in while others run.
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        runner.step()
        assert len(sched.running) <= 4
    assert all(r.is_finished() for r in reqs)
    for r in reqs:
        assert r.output_token_ids == default_tokens(r.request_id)[: r.sampling_params.max_tokens]
    assert sched.block_manager.num_free_blocks == 40


# ------------------------------------------------------------- chunked prefill


def test_long_prompt_is_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    req = make_request("long", 10, max_tokens=2)
    sched.add_request(req)
    runner = FakeRunner(sched)
    runner.run()
    chunks = [(s.scheduled[0].start_pos, len(s.scheduled[0].token_ids), s.scheduled[0].sample)
              for s in runner.steps]
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True), (10, 1, True)]
    assert req.output_token_ids == default_tokens("long")[:2]


def test_no_token_sampled_for_partial_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    req = make_request("long", 10)
    sched.add_request(req)
    out = sched.schedule()
    updated = sched.update_from_output(out, ModelRunnerOutput([], [], []))
    assert updated == []
    assert req.num_computed_tokens == 4 and req.output_token_ids == []


def test_decode_and_prefill_share_a_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 3, max_tokens=10)
    sched.add_request(a)
    runner = FakeRunner(sched)
    runner.step()  # a: prefill + first token
    b = make_request("b", 20, max_tokens=2)
    sched.add_request(b)
    runner.step()
    last = runner.steps[-1]
    assert [(s.req_id, len(s.token_ids), s.sample) for s in last.scheduled] == [
        ("a", 1, True),
        ("b", 7, False),
    ]
    runner.step()
    last = runner.steps[-1]
    # b's unfinished prefill is now running and continues after a's decode.
    assert [(s.req_id, s.start_pos, len(s.token_ids)) for s in last.scheduled] == [
        ("a", 4, 1),
        ("b", 7, 7),
    ]
    runner.run()
    assert a.output_token_ids == default_tokens("a")[:10]
    assert b.output_token_ids == default_tokens("b")[:2]


def test_long_prefill_token_threshold_caps_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    req = make_request("a", 12, max_tokens=1)
    sched.add_request(req)
    runner = FakeRunner(sched)
    runner.run()
    assert [len(s.scheduled[0].token_ids) for s in runner.steps] == [5, 5, 2]


# ------------------------------------------------------------------ preemption


def test_preemption_by_recompute_finishes_everything() -> None:
    # 6 blocks x 2 tokens = 12 slots; four requests each grow to 3 + 6 tokens.
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=6, block_size=2)
    reqs = [make_request(name, 3, max_tokens=6) for name in "abcd"]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    finished = runner.run()
    assert sorted(r.request_id for r in finished) == ["a", "b", "c", "d"]
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.output_token_ids == default_tokens(r.request_id)[:6]
        assert r.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 6
    # Every preempted request was reported so the runner could drop its KV.
    reported = {rid for s in runner.steps for rid in s.finished_req_ids}
    assert {r.request_id for r in reqs if r.num_preemptions} <= reported


def test_preemption_takes_latest_arrival_and_requeues_at_front() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=3, block_size=2)
    a, b, c = (make_request(n, 2, max_tokens=4) for n in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.step()  # each prefill takes one full block; all three sample a token
    assert all(len(r.block_ids) == 1 for r in (a, b, c))
    late = make_request("late", 1)
    sched.add_request(late)
    # a needs a second block: c (latest running) is preempted and a takes its
    # block; b then needs one too and, being the latest left, preempts itself.
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["a"]
    assert set(out.finished_req_ids) == {"b", "c"}
    assert list(sched.waiting) == [b, c, late]
    assert b.status == c.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.block_ids == []
    sched.update_from_output(out, runner.execute(out))
    # The recompute prefill of a preempted request covers prompt + outputs.
    runner.run()
    assert c.num_preemptions >= 1
    for r in (a, b, c):
        assert r.output_token_ids == default_tokens(r.request_id)[:4]


def test_strict_fcfs_head_blocks_smaller_followers() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=4, block_size=4)
    a = make_request("a", 8, max_tokens=20)  # holds 2 blocks, grows
    sched.add_request(a)
    runner = FakeRunner(sched)
    runner.step()
    big = make_request("big", 12)  # needs 3 blocks, only 2 free
    small = make_request("small", 2)  # would fit, but must not overtake
    sched.add_request(big)
    sched.add_request(small)
    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["a"]
    sched.update_from_output(out, runner.execute(out))


def test_request_outgrowing_the_cache_finishes_with_length() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    req = make_request("a", 6, max_tokens=50)
    sched.add_request(req)
    FakeRunner(sched).run()
    # Cache holds 8 tokens; once a 9th exists its KV could never be computed.
    assert req.num_tokens == 9
    assert req.finish_reason == "length"


# ----------------------------------------------------------------------- abort


def test_abort_waiting_running_unknown_and_in_flight() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4, max_tokens=50), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    runner.step()
    sched.abort_request("b")  # waiting
    assert b.status == RequestStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    sched.abort_request("nope")  # unknown: no-op
    out = sched.schedule()
    assert "b" in out.finished_req_ids
    result = runner.execute(out)
    sched.abort_request("a")  # running, aborted while its step is in flight
    assert a.block_ids == [] and a.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.update_from_output(out, result) == []
    assert a.num_output_tokens == 1  # the in-flight token was discarded
    sched.abort_request("a")  # already finished: no-op
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["a"]
    # The id can be reused after it finished. That empty output never reached the
    # runner, so the next one that does still says "a" finished (the runner drops the
    # old "a"'s state before the new "a" runs), and only that one.
    sched.add_request(make_request("a", 4))
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled] == ["a"] and out.finished_req_ids == ["a"]
    runner.execute(out)
    assert sched.schedule().finished_req_ids == []


# ------------------------------------------------------------- stop conditions


def run_one(req: Request, expected: list[int], **sched_kwargs: int) -> Request:
    sched = make_scheduler(**sched_kwargs)  # type: ignore[arg-type]
    sched.add_request(req)
    FakeRunner(sched, {req.request_id: expected}).run()
    return req


def test_eos_stops_and_is_kept() -> None:
    req = run_one(make_request("a", 3, max_tokens=10), [11, 12, EOS, 13, 14])
    assert req.output_token_ids == [11, 12, EOS]
    assert req.finish_reason == "stop" and req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = run_one(make_request("a", 3, max_tokens=5, ignore_eos=True), [11, EOS, 12, EOS, 13, 14])
    assert req.output_token_ids == [11, EOS, 12, EOS, 13]
    assert req.finish_reason == "length"


def test_no_eos_configured() -> None:
    req = run_one(make_request("a", 3, max_tokens=3), [EOS, EOS, EOS, EOS], eos_token_id=None)
    assert req.output_token_ids == [EOS, EOS, EOS]
    assert req.finish_reason == "length"


def test_stop_token_ids() -> None:
    req = run_one(make_request("a", 3, max_tokens=10, stop_token_ids=[42, 43]), [11, 43, 12])
    assert req.output_token_ids == [11, 43]
    assert req.finish_reason == "stop"


def test_stop_wins_over_length_on_the_same_token() -> None:
    req = run_one(make_request("a", 3, max_tokens=2), [11, EOS, 12])
    assert req.finish_reason == "stop"


def test_max_tokens() -> None:
    req = run_one(make_request("a", 3, max_tokens=4), default_tokens("a"))
    assert req.output_token_ids == default_tokens("a")[:4]
    assert req.finish_reason == "length"


def test_max_model_len() -> None:
    req = run_one(make_request("a", 5, max_tokens=100), default_tokens("a"), max_model_len=8)
    assert req.num_tokens == 8 and req.num_output_tokens == 3
    assert req.finish_reason == "length"


def test_prompt_of_max_model_len_minus_one_gets_one_token() -> None:
    req = run_one(make_request("a", 7, max_tokens=100), default_tokens("a"), max_model_len=8)
    assert req.num_output_tokens == 1 and req.finish_reason == "length"


def test_update_returns_requests_with_new_tokens_and_logprobs() -> None:
    sched = make_scheduler(max_num_batched_tokens=6)
    a = make_request("a", 3, max_tokens=3, logprobs=1)
    b = make_request("b", 5, max_tokens=3)  # only 3 of its 5 prompt tokens fit
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(sched)
    assert runner.step() == [a]
    assert runner.step() == [a, b]
    runner.run()
    assert a.output_logprobs == [{t: -0.5} for t in a.output_token_ids]
    assert b.output_logprobs == []


# ------------------------------------------------------------------ validation


def test_add_request_validation() -> None:
    sched = make_scheduler(max_model_len=16, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("e", [], SamplingParams()))
    with pytest.raises(ValueError, match=r"16 tokens.*max_model_len is 16"):
        sched.add_request(make_request("long", 16))
    with pytest.raises(ValueError, match=r"9 tokens.*8 tokens"):
        sched.add_request(make_request("huge", 9))
    sched.add_request(make_request("ok", 8))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3))
    assert len(sched.waiting) == 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert repr(next(iter(kwargs.values())))[:4] in str(info.value)


def test_sampling_params_defaults_and_greedy() -> None:
    assert not SamplingParams().is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    SamplingParams(top_k=-1, top_p=1.0, seed=0, logprobs=0)


def test_messages_are_picklable() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, seed=3, stop_token_ids=[5]))
    out = sched.schedule()
    clone = pickle.loads(pickle.dumps(out))
    assert clone == out


def test_any_of_several_eos_ids_stops() -> None:
    # Llama 3 style: </s> and <|eot_id|> both end generation.
    req = run_one(make_request("a", 3, max_tokens=10), [11, 12, 7, 13], eos_token_id=[EOS, 7])
    assert req.output_token_ids == [11, 12, 7]
    assert req.finish_reason == "stop"
