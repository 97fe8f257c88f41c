"""Async scheduling: step N+1 planned and sent while step N runs.

Two levels. Against the scheduler, a fake runner whose "model" makes each token from
the one before it and its position (so a placeholder put in the wrong place, or
replaced by the wrong token, changes everything after it) runs the same load both
ways: one step at a time, and planned one step ahead. Against the engine, TP=2 on
worker processes (the mp executor, the one that runs steps in the background) must
give exactly what the same engine gives one step at a time, through stop tokens,
seeded sampling, penalties, logprobs, n > 1, preemption, calls made while a step is in
flight, and a worker that raises.
"""

from __future__ import annotations

import random
import time

import pytest

from config import ConfigError, SamplingParams
from engine.block_manager import KVBlockManager
from engine.core import EngineCore
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from executor.errors import EngineDeadError, RemoteWorkerError
from tests.reliability.helpers import arm_forward_fault
from tests.runtime_helpers import DEATH_BOUND_S, engine_config
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput

EOS = 2
VOCAB = 60


def next_token(req_id: str, position: int, token: int) -> int:
    """The fake model: the token after `token` at `position` (EOS now and then)."""
    if (token * 13 + position * 7 + len(req_id)) % 29 == 0:
        return EOS
    return 3 + (token * 31 + position * 17 + sum(map(ord, req_id))) % (VOCAB - 3)


class ChainRunner:
    """A model runner stand-in with a real runner's per-request state: where its KV
    ends, and the token it sampled last (what a placeholder stands for)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.computed: dict[str, int] = {}
        self.last_sampled: dict[str, int] = {}
        self.placeholders_seen = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.computed.pop(req_id, None)
            self.last_sampled.pop(req_id, None)
        req_ids, tokens = [], []
        for s in out.scheduled:
            ids = list(s.token_ids)
            assert PLACEHOLDER_TOKEN_ID not in ids[:-1], "a placeholder is only ever the last token"
            if ids[-1] == PLACEHOLDER_TOKEN_ID:
                assert s.req_id in self.last_sampled, f"{s.req_id}: placeholder with nothing sampled before it"
                ids[-1] = self.last_sampled[s.req_id]
                self.placeholders_seen += 1
            # The chunk continues where this runner's KV ends (a re-admission from a
            # cached prefix starts past 0 on a runner that forgot the request).
            if s.req_id in self.computed:
                assert s.start_pos == self.computed[s.req_id], (s.req_id, s.start_pos, self.computed[s.req_id])
            end = s.start_pos + len(ids)
            assert len(s.block_ids) * self.block_size >= end
            self.computed[s.req_id] = end
            if s.sample:
                token = next_token(s.req_id, end - 1, ids[-1])
                self.last_sampled[s.req_id] = token
                req_ids.append(s.req_id)
                tokens.append(token)
        return ModelRunnerOutput(req_ids, tokens, [None] * len(tokens))


def make_scheduler(num_blocks: int, block_size: int = 4, budget: int = 24, max_seqs: int = 6,
                   caching: bool = True) -> Scheduler:
    return Scheduler(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=96,
                     block_manager=KVBlockManager(num_blocks, block_size, enable_caching=caching),
                     eos_token_id=EOS)


def make_requests(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        # Shared openings, so the prefix cache hits; some requests ignore EOS.
        prompt = [10 + (i % 3)] * rng.randint(0, 9) + [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=[rng.randint(3, VOCAB - 1)] if rng.random() < 0.3 else [])
        requests.append(Request(f"r{i}", prompt, params))
    return requests


def drive(scheduler: Scheduler, runner: ChainRunner, requests: list[Request], ahead: bool, seed: int) -> int:
    """Run `requests` to the end, adding them over time; returns the steps run. With
    `ahead`, each step is planned before the previous one's result is applied."""
    rng = random.Random(seed)
    pending = list(requests)
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    steps = 0
    for _ in range(20_000):
        while pending and rng.random() < 0.3:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            if in_flight is not None:  # planned behind a stop: dropped when applied
                assert scheduler.update_from_output(*in_flight) == []
            return steps
        if not ahead:
            out = scheduler.schedule()
            if out.scheduled:
                scheduler.update_from_output(out, runner.execute(out))
                steps += 1
            continue
        if in_flight is None:
            out = scheduler.schedule()
            if not out.scheduled:
                continue
            in_flight = out, runner.execute(out)  # the ranks run steps in the order they were sent
            steps += 1
        following = scheduler.schedule()
        step, in_flight = in_flight, None
        if following.scheduled:
            in_flight = following, runner.execute(following)
            steps += 1
        scheduler.update_from_output(*step)
    raise AssertionError("the scheduler did not drain")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [12, 200])  # 12: preemption all the time
def test_planned_ahead_gives_what_one_step_at_a_time_gives(seed, num_blocks):
    results = {}
    for ahead in (False, True):
        scheduler = make_scheduler(num_blocks)
        runner = ChainRunner(block_size=4)
        requests = make_requests(seed, 24)
        drive(scheduler, runner, requests, ahead, seed)
        assert all(r.is_finished() for r in requests)
        assert scheduler.block_manager.num_free_blocks == num_blocks
        assert scheduler.num_outstanding_steps == 0 and not scheduler.running
        if ahead:
            assert runner.placeholders_seen > 0
        results[ahead] = [(r.output_token_ids, r.finish_reason, r.stop_reason) for r in requests]
        if num_blocks == 12:
            assert sum(r.num_preemptions for r in requests) > 0
    assert results[True] == results[False]


def test_a_request_its_pending_token_ends_is_not_scheduled_again():
    """max_tokens is known ahead: a request's last step has nothing scheduled behind it."""
    scheduler = make_scheduler(64)
    runner = ChainRunner(block_size=4)
    request = Request("a", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add_request(request)
    first = scheduler.schedule()  # prefill, samples output 1
    second = scheduler.schedule()  # planned on the placeholder: samples output 2, the last
    assert second.scheduled[0].token_ids == [PLACEHOLDER_TOKEN_ID]
    assert second.scheduled[0].start_pos == 3 and second.scheduled[0].num_output_tokens == 1
    scheduler.update_from_output(first, runner.execute(first))
    third = scheduler.schedule()
    assert not third.scheduled  # nothing to plan behind the last token
    scheduler.update_from_output(second, runner.execute(second))
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 2


def test_a_step_behind_a_stop_is_dropped_and_its_blocks_come_back():
    scheduler = make_scheduler(64)
    runner = ChainRunner(block_size=4)
    prompt = [5, 6, 7]
    stop = next_token("a", 2, 7)  # the first token it samples
    request = Request("a", prompt, SamplingParams(max_tokens=10, stop_token_ids=[stop]))
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.update_from_output(first, runner.execute(first))
    assert request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids == [stop]
    assert scheduler.block_manager.num_free_blocks == 64
    assert scheduler.update_from_output(second, runner.execute(second)) == []  # dropped
    assert request.output_token_ids == [stop]
    assert "a" in scheduler.schedule().finished_req_ids or not scheduler.has_unfinished_requests()


def test_a_new_request_with_a_finished_ones_id_gets_none_of_its_tokens():
    scheduler = make_scheduler(64)
    runner = ChainRunner(block_size=4)
    old = Request("a", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    scheduler.add_request(old)
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.abort_request("a")
    new = Request("a", [8, 9], SamplingParams(max_tokens=10, ignore_eos=True))
    scheduler.add_request(new)
    scheduler.update_from_output(first, runner.execute(first))
    third = scheduler.schedule()  # admits the new "a" while `second` (the old one's) is out
    scheduler.update_from_output(second, runner.execute(second))
    assert new.output_token_ids == [] and old.output_token_ids == []
    scheduler.update_from_output(third, ChainRunner(block_size=4).execute(third))
    assert new.output_token_ids == [next_token("a", 1, 9)]


def test_outputs_are_applied_in_order_and_at_most_one_is_planned_ahead():
    scheduler = make_scheduler(64)
    runner = ChainRunner(block_size=4)
    scheduler.add_request(Request("a", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True)))
    first = scheduler.schedule()
    second = scheduler.schedule()
    with pytest.raises(RuntimeError, match="at most one step is planned ahead"):
        scheduler.schedule()
    first_result, second_result = runner.execute(first), runner.execute(second)
    with pytest.raises(RuntimeError, match="oldest outstanding"):
        scheduler.update_from_output(second, second_result)
    scheduler.update_from_output(first, first_result)
    with pytest.raises(RuntimeError, match="oldest outstanding"):
        scheduler.update_from_output(first, first_result)
    scheduler.update_from_output(second, second_result)


def test_a_block_its_placeholder_fills_is_named_once_the_token_is_known():
    scheduler = make_scheduler(64, block_size=4)
    runner = ChainRunner(block_size=4)
    request = Request("a", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))
    scheduler.add_request(request)
    first = scheduler.schedule()  # positions 0-2
    second = scheduler.schedule()  # position 3 (a placeholder) fills block 0
    assert request.num_cached_blocks == 0
    scheduler.update_from_output(first, runner.execute(first))
    third = scheduler.schedule()  # position 3's token is known now
    assert request.num_cached_blocks == 1
    scheduler.update_from_output(second, runner.execute(second))
    scheduler.update_from_output(third, runner.execute(third))


# ------------------------------------------------------------------ the engine

PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 6], [7] * 12, [3, 1, 4, 1, 5, 9, 2, 6], [11, 12]]


def mixed_params(stops: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stops[0]]),
        SamplingParams(max_tokens=17, temperature=0.9, seed=7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, n=2, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stops[1]], logprobs=1),
    ]


def run_engine(model, params, async_scheduling, **overrides):
    config = engine_config(model, tp=2, async_scheduling=async_scheduling, **overrides)
    with EngineCore(config) as core:
        assert core.async_scheduling is async_scheduling
        outputs = core.generate(PROMPTS, params)
    return [[(c.token_ids, c.finish_reason, c.logprobs, c.cumulative_logprob) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def stop_tokens(tiny_models):
    """A token each of two greedy requests makes part-way, to stop them there."""
    with EngineCore(engine_config(tiny_models["llama"], tp=1)) as core:
        outs = core.generate([PROMPTS[0], PROMPTS[4]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    return [outs[0].outputs[0].token_ids[6], outs[1].outputs[0].token_ids[3]]


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["roomy", "tight"])
def test_engine_async_equals_one_step_at_a_time_tp2(tiny_models, stop_tokens, kv):
    # "tight": a cache of 6 blocks of 16 tokens, so the 6 sequences preempt each other.
    overrides = ({"num_gpu_blocks_override": 6, "kv_cache_memory_bytes": None, "max_model_len": 64,
                  "max_num_batched_tokens": 64} if kv == "tight" else {})
    params = mixed_params(stop_tokens)
    one_at_a_time = run_engine(tiny_models["llama"], params, False, **overrides)
    ahead = run_engine(tiny_models["llama"], params, True, **overrides)
    assert ahead == one_at_a_time
    assert one_at_a_time[0][0][1] == "stop" and one_at_a_time[4][0][1] == "stop"
    assert len(one_at_a_time[3][0][0]) == 1


@pytest.mark.slow
def test_calls_between_steps_wait_for_the_step_in_flight(tiny_models):
    """A collective_rpc (and sleep/wake, update_weights: all go through it) made while a
    step is in flight runs after it; the step's result is still applied."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
        assert core.async_scheduling  # the mp executor's default
        expected = [o.outputs[0].token_ids for o in core.generate(PROMPTS, params)]
        for prompt in PROMPTS:
            core.add_request(prompt, params)
        done: dict[str, list[int]] = {}
        steps = 0
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
            assert core.scheduler.num_outstanding_steps <= 1
            if steps % 3 == 1:
                assert core.collective_rpc(lambda worker: worker.rank) == [0, 1]
        assert [done[f"req-{i}"] for i in range(len(PROMPTS), 2 * len(PROMPTS))] == expected


@pytest.mark.slow
def test_a_rank_that_raises_with_a_step_queued_behind_fails_the_engine_fast(tiny_models):
    """Rank 1 raises in a forward that rank 0 runs on (rank 0 waits in an all-reduce
    for it) while the next step is already queued: no hang; the step's caller gets the
    error naming rank 1, and the next call finds the group out of step."""
    with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
        core.collective_rpc(arm_forward_fault, args=(1, "raise", 4))
        start = time.monotonic()
        with pytest.raises((RemoteWorkerError, EngineDeadError), match="rank 1|rank\\(s\\)"):
            core.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert time.monotonic() - start < DEATH_BOUND_S
        assert core.scheduler.num_outstanding_steps == 0
        with pytest.raises(EngineDeadError):
            core.collective_rpc("check_health", timeout=60)
        assert time.monotonic() - start < 2 * DEATH_BOUND_S


def fail_next_step_on_every_rank(worker) -> None:
    """RPC body: every rank's next execute_model raises before its forward."""
    runner = worker.model_runner
    original = runner.execute_model

    def execute_model(scheduler_output):
        runner.execute_model = original
        raise RuntimeError(f"injected step failure on rank {worker.rank}")

    runner.execute_model = execute_model


@pytest.mark.slow
def test_a_step_that_fails_on_every_rank_is_rerun(tiny_models):
    """Every rank raises in one step (no collective left waiting): the caller gets the
    error, the step queued behind it is dropped, and the engine goes on: the requests
    are re-run from their tokens and end as they would have."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
        expected = [o.outputs[0].token_ids for o in core.generate(PROMPTS, params)]
        for prompt in PROMPTS:
            core.add_request(prompt, params)
        core.step()
        core.step()
        core.collective_rpc(fail_next_step_on_every_rank)
        with pytest.raises(RemoteWorkerError, match="injected step failure"):
            for _ in range(3):
                core.step()
        assert core.scheduler.num_outstanding_steps == 0
        assert all(r.status == RequestStatus.PREEMPTED for r in core.scheduler.waiting)
        done: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert [done[f"req-{i}"] for i in range(len(PROMPTS), 2 * len(PROMPTS))] == expected


def test_async_scheduling_needs_an_executor_that_runs_steps_in_the_background(tiny_models):
    with pytest.raises(ConfigError, match="async_scheduling=True.*UniProcExecutor"):
        EngineCore(engine_config(tiny_models["llama"], tp=1, async_scheduling=True))
    with pytest.raises(ConfigError, match="async_scheduling='yes'"):
        engine_config(tiny_models["llama"], async_scheduling="yes")
    with EngineCore(engine_config(tiny_models["llama"], tp=1)) as core:
        assert not core.async_scheduling  # uni: one step at a time
