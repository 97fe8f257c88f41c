"""Multi-step decode (vLLM V0's ``--num-scheduler-steps``): one scheduler output runs up
to ``num_scheduler_steps`` decode steps back to back.

Three levels. Against the scheduler (a real KVBlockManager, a fake runner): when an
output is multi-step and how many steps it gets, that the slots of every step are
allocated up front, that the tokens are applied in step order with everything after a
stop dropped, and that planning one output ahead (async scheduling) still resolves the
placeholders; a random load must end exactly as it does one step at a time. Against the
engine (a tiny float32 llama, TP=1 in process and TP=2 on mp workers with async
scheduling): a mixed batch gives the same tokens, finish reasons and logprobs with
``num_scheduler_steps=4`` as with 1. And the config, CLI-facing validation and the
generation-token metric of the AsyncEngine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from config import ConfigError, RequestOutputKind, SamplingParams
from engine.block_manager import KVBlockManager
from engine.core import EngineCore
from engine.metrics import PREFIX
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.runtime_helpers import engine_config
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput

EOS = 2
VOCAB = 60


# ============================================================ scheduler, fake runner


def next_token(req_id: str, position: int, token: int) -> int:
    """The fake model: the token after `token` at `position` (EOS now and then), so a
    token fed at the wrong place or step changes everything after it."""
    if (token * 13 + position * 7 + len(req_id)) % 29 == 0:
        return EOS
    return 3 + (token * 31 + position * 17 + sum(map(ord, req_id))) % (VOCAB - 3)


def chain(req_id: str, prompt: list[int], n: int) -> list[int]:
    """The first `n` tokens the fake model makes for `prompt` (EOS included)."""
    tokens, token = [], prompt[-1]
    for k in range(n):
        token = next_token(req_id, len(prompt) - 1 + k, token)
        tokens.append(token)
    return tokens


def fake_logprob(index: int) -> float:
    """The logprob the fake runner reports for a request's output number `index`."""
    return -0.01 * (index + 1)


class MultiStepRunner:
    """A model runner stand-in for multi-step outputs, with a real runner's per-request
    state (where its KV ends, the token it sampled last, the params it was sent).

    Each step's token comes from the token before it and its position (`next_token`),
    or from `script[req_id][output index]` where a script is given. It checks each
    output: a multi-step one only decodes (one token per request, every one sampling),
    each request's block table covers the slots of all its steps, chunks continue where
    the runner's KV ends, and `num_output_tokens` is the output index the first step
    samples."""

    def __init__(self, scheduler: Scheduler, script: dict[str, list[int]] | None = None) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_manager.block_size
        self.script = script or {}
        self.computed: dict[str, int] = {}
        self.last_sampled: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.prompt_lens: dict[str, int] = {}
        self.placeholders_seen = 0
        self.num_steps_run: list[int] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert out.scheduled, "an empty output is never run"
        assert out.num_steps >= 1
        self.num_steps_run.append(out.num_steps)
        for req_id in out.finished_req_ids:
            for state in (self.computed, self.last_sampled, self.params, self.prompt_lens):
                state.pop(req_id, None)
        tables: dict[str, list[int]] = {}
        written: dict[str, set[int]] = {}
        req_ids: list[str] = []
        steps: list[list[int]] = [[] for _ in range(out.num_steps)]
        logprobs: list[list[dict[int, float]]] = [[] for _ in range(out.num_steps)]
        for s in out.scheduled:
            if s.sampling_params is not None:
                assert s.req_id not in self.params, f"{s.req_id}: params sent twice"
                self.params[s.req_id] = s.sampling_params
                self.prompt_lens[s.req_id] = len(self.scheduler.requests[s.req_id].prompt_token_ids)
            assert s.req_id in self.params, f"{s.req_id}: scheduled before its params were sent"
            ids = list(s.token_ids)
            assert PLACEHOLDER_TOKEN_ID not in ids[:-1], "a placeholder is only ever the last token"
            if ids[-1] == PLACEHOLDER_TOKEN_ID:
                assert s.req_id in self.last_sampled, f"{s.req_id}: placeholder with nothing sampled before it"
                ids[-1] = self.last_sampled[s.req_id]
                self.placeholders_seen += 1
            if s.req_id in self.computed:
                assert s.start_pos == self.computed[s.req_id], (s.req_id, s.start_pos, self.computed[s.req_id])
            end = s.start_pos + len(ids)
            if out.num_steps > 1:
                assert s.sample and len(ids) == 1, f"{s.req_id}: a multi-step output must only decode"
            # Every step's slot is there: positions start_pos .. end + num_steps - 2.
            assert len(s.block_ids) * self.block_size >= end + out.num_steps - 1, (s.req_id, s.block_ids, end)
            tables[s.req_id] = s.block_ids
            last_slot = end + out.num_steps - 2
            written[s.req_id] = set(s.block_ids[s.start_pos // self.block_size: last_slot // self.block_size + 1])
            self.computed[s.req_id] = end + out.num_steps - 1
            if not s.sample:
                continue
            first_index = end - self.prompt_lens[s.req_id]
            assert s.num_output_tokens == first_index, (s.req_id, s.num_output_tokens, first_index)
            req_ids.append(s.req_id)
            token, position = ids[-1], end - 1
            for k in range(out.num_steps):
                index = first_index + k
                script = self.script.get(s.req_id)
                token = script[index] if script is not None else next_token(s.req_id, position + k, token)
                steps[k].append(token)
                logprobs[k].append({token: fake_logprob(index)})
            self.last_sampled[s.req_id] = token
        # A block that a step writes to is nobody else's (cached prefix blocks, full and
        # only read, may be shared).
        for req_id, blocks in written.items():
            for other, table in tables.items():
                assert other == req_id or not blocks & set(table), f"{req_id} writes to a block of {other}"
        return ModelRunnerOutput(req_ids, steps[0], logprobs[0], later_token_ids=steps[1:],
                                 later_logprobs=logprobs[1:])

    def step(self) -> SchedulerOutput:
        """Schedule, run and apply one output (one step at a time)."""
        out = self.scheduler.schedule()
        if out.scheduled:
            self.scheduler.update_from_output(out, self.execute(out))
        return out

    def run(self, max_steps: int = 10_000) -> list[SchedulerOutput]:
        outputs = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return outputs
            out = self.step()
            if out.scheduled:
                outputs.append(out)
        raise AssertionError("the scheduler did not drain")


def make_scheduler(num_scheduler_steps: int, *, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, max_model_len: int = 128, caching: bool = True) -> Scheduler:
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                     block_manager=KVBlockManager(num_blocks, block_size, enable_caching=caching),
                     eos_token_id=EOS, num_scheduler_steps=num_scheduler_steps)


def make_request(req_id: str, num_prompt: int, **params: Any) -> Request:
    prompt = [3 + (sum(map(ord, req_id)) * 5 + 7 * i) % (VOCAB - 3) for i in range(num_prompt)]
    return Request(req_id, prompt, SamplingParams(**params))


def blocks_for(num_tokens: int, block_size: int = 4) -> int:
    return -(-num_tokens // block_size)


def test_scheduler_rejects_fewer_than_one_step() -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1, got 0"):
        make_scheduler(0)


def test_a_pure_decode_batch_runs_k_steps_with_every_steps_slot_allocated() -> None:
    sched = make_scheduler(4)
    runner = MultiStepRunner(sched)
    reqs = [make_request("a", 3, max_tokens=20, ignore_eos=True, logprobs=1),
            make_request("b", 4, max_tokens=20, ignore_eos=True),
            make_request("c", 6, max_tokens=20, ignore_eos=True)]
    for r in reqs:
        sched.add_request(r)
    first = runner.step()
    assert first.num_steps == 1  # prefills
    free_before = sched.block_manager.num_free_blocks

    out = sched.schedule()
    assert out.num_steps == 4
    assert out.num_batched_tokens == 3 and out.finished_req_ids == []
    assert [(s.req_id, s.start_pos, len(s.token_ids), s.sample, s.num_output_tokens) for s in out.scheduled] == [
        ("a", 3, 1, True, 1), ("b", 4, 1, True, 1), ("c", 6, 1, True, 1)]
    for s, r in zip(out.scheduled, reqs):
        # Exactly the blocks that hold positions 0 .. start_pos + 3, all taken now.
        assert s.block_ids == r.block_ids and len(s.block_ids) == blocks_for(s.start_pos + 4)
        assert r.num_computed_tokens == s.start_pos + 4 and r.num_output_placeholders == 4
        assert s.token_ids == [r.output_token_ids[-1]]  # the token sampled before: not a placeholder
    taken = sum(blocks_for(s.start_pos + 4) - blocks_for(s.start_pos) for s in out.scheduled)
    assert sched.block_manager.num_free_blocks == free_before - taken

    updated = sched.update_from_output(out, runner.execute(out))
    assert updated == reqs
    for r in reqs:
        # Four tokens each, in step order, each the one its predecessor led to.
        assert r.output_token_ids == chain(r.request_id, r.prompt_token_ids, 5)
        assert r.num_output_placeholders == 0 and r.num_computed_tokens == r.num_tokens - 1
        assert r.status == RequestStatus.RUNNING
    a = reqs[0]
    assert a.output_logprobs == [{t: fake_logprob(i)} for i, t in enumerate(a.output_token_ids)]
    assert a.cumulative_logprob == pytest.approx(sum(fake_logprob(i) for i in range(5)))
    assert reqs[1].output_logprobs == []  # did not ask

    runner.run()
    for r in reqs:
        assert r.output_token_ids == chain(r.request_id, r.prompt_token_ids, 20)
        assert r.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    # 1 prefill, then 19 tokens: four outputs of 4 and the last 3 in one.
    assert runner.num_steps_run == [1, 4, 4, 4, 4, 3]


def test_num_steps_is_clamped_to_the_smallest_remaining_max_tokens() -> None:
    sched = make_scheduler(8)
    runner = MultiStepRunner(sched)
    short = make_request("short", 3, max_tokens=4, ignore_eos=True)
    long = make_request("long", 5, max_tokens=20, ignore_eos=True)
    for r in (short, long):
        sched.add_request(r)
    runner.step()  # prefills: one token each
    out = sched.schedule()
    assert out.num_steps == 3  # short has 3 tokens left; long could take 8
    assert [len(s.block_ids) for s in out.scheduled] == [blocks_for(3 + 3), blocks_for(5 + 3)]
    sched.update_from_output(out, runner.execute(out))
    assert short.finish_reason == "length" and short.num_output_tokens == 4
    assert short.output_token_ids == chain("short", short.prompt_token_ids, 4)
    out = sched.schedule()
    assert out.num_steps == 8 and [s.req_id for s in out.scheduled] == ["long"]
    assert out.finished_req_ids == ["short"]
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert out.num_steps == 20 - 12  # what long has left
    sched.update_from_output(out, runner.execute(out))
    assert long.finish_reason == "length" and long.output_token_ids == chain("long", long.prompt_token_ids, 20)
    assert not sched.has_unfinished_requests()


def test_num_steps_never_runs_past_max_model_len_or_the_cache() -> None:
    """The model length and the whole cache bound a multi-step output too: the request
    ends with "length" after exactly the tokens it gets one step at a time."""
    def run(k: int, **kwargs: Any) -> tuple[Request, list[int]]:
        sched = make_scheduler(k, **kwargs)
        req = make_request("a", 10, max_tokens=50, ignore_eos=True)
        sched.add_request(req)
        runner = MultiStepRunner(sched)
        runner.run()
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        return req, runner.num_steps_run

    one, _ = run(1, max_model_len=16)
    multi, steps = run(8, max_model_len=16)
    assert multi.output_token_ids == one.output_token_ids == chain("a", multi.prompt_token_ids, 6)
    assert multi.finish_reason == one.finish_reason == "length" and multi.num_tokens == 16
    assert steps == [1, 5]  # 11 tokens after the prefill: 5 more reach max_model_len

    # 4 blocks of 4: 16 tokens of KV. The runner checks every step's slot is in the table.
    one, _ = run(1, num_blocks=4)
    multi, steps = run(8, num_blocks=4)
    assert multi.output_token_ids == one.output_token_ids and multi.finish_reason == one.finish_reason == "length"
    assert max(steps) > 1


def test_a_waiting_request_makes_every_output_single_step() -> None:
    sched = make_scheduler(4, max_num_seqs=1)
    a = make_request("a", 3, max_tokens=6, ignore_eos=True)
    b = make_request("b", 3, max_tokens=9, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)  # waits: one sequence at a time
    runner = MultiStepRunner(sched)
    outputs = runner.run()
    by_request = [([s.req_id for s in o.scheduled], o.num_steps) for o in outputs]
    # a decodes one token per output while b waits; b, alone, runs 4 steps at once.
    assert by_request == [(["a"], 1)] * 6 + [(["b"], 1), (["b"], 4), (["b"], 4)]
    assert a.output_token_ids == chain("a", a.prompt_token_ids, 6)
    assert b.output_token_ids == chain("b", b.prompt_token_ids, 9)


def test_an_arriving_request_interrupts_multi_step_until_it_is_admitted() -> None:
    sched = make_scheduler(4)
    runner = MultiStepRunner(sched)
    a = make_request("a", 3, max_tokens=30, ignore_eos=True)
    sched.add_request(a)
    runner.step()
    assert runner.step().num_steps == 4
    c = make_request("c", 5, max_tokens=30, ignore_eos=True)
    sched.add_request(c)
    out = runner.step()  # c's prefill beside a's decode
    assert out.num_steps == 1 and [s.req_id for s in out.scheduled] == ["a", "c"]
    out = runner.step()
    assert out.num_steps == 4 and [len(s.token_ids) for s in out.scheduled] == [1, 1]
    runner.run()
    assert a.output_token_ids == chain("a", a.prompt_token_ids, 30)
    assert c.output_token_ids == chain("c", c.prompt_token_ids, 30)


def test_a_request_with_stop_strings_makes_every_output_single_step() -> None:
    sched = make_scheduler(4)
    runner = MultiStepRunner(sched)
    texty = make_request("texty", 3, max_tokens=5, ignore_eos=True, stop=["zz"])
    plain = make_request("plain", 4, max_tokens=14, ignore_eos=True)
    sched.add_request(texty)
    sched.add_request(plain)
    runner.run()
    # While texty runs (5 outputs: prefill + 4 decodes) one step each; then plain alone.
    assert runner.num_steps_run == [1, 1, 1, 1, 1, 4, 4, 1]
    assert plain.output_token_ids == chain("plain", plain.prompt_token_ids, 14)


def test_a_request_mid_prefill_makes_every_output_single_step() -> None:
    sched = make_scheduler(4, budget=4)
    runner = MultiStepRunner(sched)
    a = make_request("a", 3, max_tokens=30, ignore_eos=True)
    sched.add_request(a)
    runner.step()
    assert runner.step().num_steps == 4
    long = make_request("long", 11, max_tokens=30, ignore_eos=True)
    sched.add_request(long)
    chunks = []
    while True:
        out = runner.step()
        chunks.append([(s.req_id, len(s.token_ids), s.sample) for s in out.scheduled])
        assert out.num_steps == 1
        if any(s.req_id == "long" and s.sample for s in out.scheduled):
            break
    # a's decode plus 3 prompt tokens per step, until the chunk that samples. (A last
    # chunk of one token would be a decode like a's, and may start a multi-step output.)
    assert chunks == [[("a", 1, True), ("long", 3, False)], [("a", 1, True), ("long", 3, False)],
                      [("a", 1, True), ("long", 3, False)], [("a", 1, True), ("long", 2, True)]]
    assert runner.step().num_steps == 4  # both decode now
    runner.run()
    assert a.output_token_ids == chain("a", a.prompt_token_ids, 30)
    assert long.output_token_ids == chain("long", long.prompt_token_ids, 30)


def test_too_few_free_blocks_means_one_step_and_no_preemption() -> None:
    # 3-token prompts in blocks of 4: one block each, and the next token still fits in
    # it. Four steps need a second block each (2), but only 1 is free.
    sched = make_scheduler(4, num_blocks=3)
    runner = MultiStepRunner(sched)
    a = make_request("a", 3, max_tokens=10, ignore_eos=True)
    b = make_request("b", 3, max_tokens=10, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    runner.step()
    assert sched.block_manager.num_free_blocks == 1
    out = sched.schedule()
    assert out.num_steps == 1 and [s.req_id for s in out.scheduled] == ["a", "b"]
    assert out.finished_req_ids == [] and not sched.waiting
    assert a.num_preemptions == b.num_preemptions == 0
    assert sched.block_manager.num_free_blocks == 1 and len(a.block_ids) == len(b.block_ids) == 1
    sched.update_from_output(out, runner.execute(out))
    assert a.num_output_placeholders == 0 and a.num_tokens == 5

    # With exactly the blocks every step needs, the output is multi-step.
    roomy = make_scheduler(4, num_blocks=4)
    runner = MultiStepRunner(roomy)
    for name in "ab":
        roomy.add_request(make_request(name, 3, max_tokens=10, ignore_eos=True))
    runner.step()
    assert roomy.block_manager.num_free_blocks == 2
    out = roomy.schedule()
    assert out.num_steps == 4 and roomy.block_manager.num_free_blocks == 0
    assert out.finished_req_ids == []


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_a_stop_at_step_two_of_four_ends_the_request_and_drops_the_later_tokens(how: str) -> None:
    sched = make_scheduler(4)
    stop = EOS if how == "eos" else 44
    params = dict(max_tokens=20, logprobs=0) if how == "eos" else dict(max_tokens=20, stop_token_ids=[44, 45])
    a = make_request("a", 3, **params)
    b = make_request("b", 5, max_tokens=20, ignore_eos=True)
    # Output 0 comes with the prefill; the multi-step output samples outputs 1-4: stop at 2.
    runner = MultiStepRunner(sched, {"a": [11, 12, stop, 13, 14, 15, 16, 17]})
    for r in (a, b):
        sched.add_request(r)
    runner.step()
    out = sched.schedule()
    assert out.num_steps == 4
    result = runner.execute(out)
    assert [result.sampled_token_ids[0]] + [step[0] for step in result.later_token_ids] == [12, stop, 13, 14]
    updated = sched.update_from_output(out, result)
    assert updated == [a, b]
    assert a.output_token_ids == [11, 12, stop]  # 13 and 14 were dropped
    assert a.status == RequestStatus.FINISHED_STOPPED and a.finish_reason == "stop"
    assert a.stop_reason == (None if how == "eos" else stop)
    if how == "eos":
        assert a.output_logprobs == [{11: fake_logprob(0)}, {12: fake_logprob(1)}, {stop: fake_logprob(2)}]
    assert a.block_ids == [] and "a" not in sched.requests and a not in sched.running
    # b's four tokens all came in.
    assert b.output_token_ids == chain("b", b.prompt_token_ids, 5)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - len(b.block_ids)
    nxt = sched.schedule()
    assert nxt.finished_req_ids == ["a"] and [s.req_id for s in nxt.scheduled] == ["b"]
    assert nxt.num_steps == 4
    sched.update_from_output(nxt, runner.execute(nxt))
    runner.run()
    assert b.output_token_ids == chain("b", b.prompt_token_ids, 20)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def _multi_step_output() -> tuple[Scheduler, SchedulerOutput, ModelRunnerOutput]:
    sched = make_scheduler(4)
    runner = MultiStepRunner(sched)
    for name in "ab":
        sched.add_request(make_request(name, 3, max_tokens=20, ignore_eos=True))
    runner.step()
    out = sched.schedule()
    assert out.num_steps == 4
    return sched, out, runner.execute(out)


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_a_runner_output_with_another_number_of_steps_raises(steps: int) -> None:
    sched, out, good = _multi_step_output()
    later = good.later_token_ids + [[7, 7]]
    bad = ModelRunnerOutput(good.req_ids, good.sampled_token_ids, good.logprobs,
                            later_token_ids=later[: steps - 1], later_logprobs=[[None, None]] * (steps - 1))
    with pytest.raises(RuntimeError, match=f"runner returned {steps} steps of tokens for an output of 4 steps"):
        sched.update_from_output(out, bad)


def test_later_logprobs_must_have_a_list_per_step_too() -> None:
    sched, out, good = _multi_step_output()
    bad = ModelRunnerOutput(good.req_ids, good.sampled_token_ids, good.logprobs,
                            later_token_ids=good.later_token_ids, later_logprobs=good.later_logprobs[:2])
    with pytest.raises(RuntimeError, match="for an output of 4 steps"):
        sched.update_from_output(out, bad)


def test_a_single_step_output_refuses_later_tokens() -> None:
    sched = make_scheduler(4)
    sched.add_request(make_request("a", 3, max_tokens=5, ignore_eos=True))
    out = sched.schedule()
    assert out.num_steps == 1
    with pytest.raises(RuntimeError, match="runner returned 2 steps of tokens for an output of 1 steps"):
        sched.update_from_output(out, ModelRunnerOutput(["a"], [9], [None], later_token_ids=[[9]],
                                                        later_logprobs=[[None]]))


def test_planned_ahead_multi_step_outputs_resolve_their_placeholders() -> None:
    sched = make_scheduler(4)
    runner = MultiStepRunner(sched)
    a = Request("a", [5, 6, 7], SamplingParams(max_tokens=11, ignore_eos=True))
    sched.add_request(a)
    first = sched.schedule()  # prefill, samples output 0
    assert first.num_steps == 1  # a was waiting
    second = sched.schedule()  # planned on first's placeholder: outputs 1-4
    assert second.num_steps == 4
    [s] = second.scheduled
    assert (s.token_ids, s.start_pos, s.num_output_tokens) == ([PLACEHOLDER_TOKEN_ID], 3, 1)
    assert len(s.block_ids) == blocks_for(3 + 4)
    assert a.num_output_placeholders == 5 and a.num_computed_tokens == 7
    sched.update_from_output(first, runner.execute(first))
    third = sched.schedule()  # while second (4 steps) is out: outputs 5-8
    assert third.num_steps == 4
    [s] = third.scheduled
    assert (s.token_ids, s.start_pos, s.num_output_tokens) == ([PLACEHOLDER_TOKEN_ID], 7, 5)
    sched.update_from_output(second, runner.execute(second))
    assert a.output_token_ids == chain("a", [5, 6, 7], 5)
    fourth = sched.schedule()  # 11 - 5 - 4: two left
    assert fourth.num_steps == 2
    [s] = fourth.scheduled
    assert (s.token_ids, s.start_pos, s.num_output_tokens) == ([PLACEHOLDER_TOKEN_ID], 11, 9)
    sched.update_from_output(third, runner.execute(third))
    assert not sched.schedule().scheduled  # fourth's tokens end it: nothing planned behind it
    sched.update_from_output(fourth, runner.execute(fourth))
    assert a.finish_reason == "length" and a.output_token_ids == chain("a", [5, 6, 7], 11)
    assert runner.placeholders_seen == 3 and runner.num_steps_run == [1, 4, 4, 2]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_stop_inside_a_multi_step_output_drops_the_output_planned_behind_it() -> None:
    sched = make_scheduler(4)
    a = make_request("a", 3, max_tokens=20)
    b = make_request("b", 5, max_tokens=20, ignore_eos=True)
    runner = MultiStepRunner(sched, {"a": [11, 12, EOS, 13, 14, 15, 16, 17, 18, 19]})
    for r in (a, b):
        sched.add_request(r)
    first = sched.schedule()
    second = sched.schedule()  # outputs 1-4 of both; a's EOS is its step 2
    sched.update_from_output(first, runner.execute(first))
    third = sched.schedule()  # outputs 5-8, planned before second's tokens are known
    assert second.num_steps == third.num_steps == 4 and [s.req_id for s in third.scheduled] == ["a", "b"]
    sched.update_from_output(second, runner.execute(second))
    assert a.output_token_ids == [11, 12, EOS] and a.finish_reason == "stop"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - len(b.block_ids)
    assert sched.update_from_output(third, runner.execute(third)) == [b]  # a's part is dropped
    assert a.output_token_ids == [11, 12, EOS]
    assert b.output_token_ids == chain("b", b.prompt_token_ids, 9)
    runner.run()
    assert b.output_token_ids == chain("b", b.prompt_token_ids, 20)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def random_requests(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        # Shared openings (the prefix cache hits); long ones reach max_model_len.
        prompt = [10 + (i % 3)] * rng.randint(0, 9) + [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=[rng.randint(3, VOCAB - 1)] if rng.random() < 0.3 else [],
                                stop=["zz"] if rng.random() < 0.05 else [], logprobs=1 if rng.random() < 0.3 else None)
        requests.append(Request(f"r{i}", prompt, params))
    return requests


def drive(scheduler: Scheduler, runner: MultiStepRunner, requests: list[Request], ahead: bool, seed: int,
          arrival: float) -> None:
    """Run `requests` to the end, adding them over time. With `ahead`, each output is
    planned before the previous one's result is applied (async scheduling)."""
    rng = random.Random(seed)
    pending = list(requests)
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    for _ in range(20_000):
        while pending and rng.random() < arrival:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            if in_flight is not None:  # planned behind a stop: dropped when applied
                assert scheduler.update_from_output(*in_flight) == []
            return
        if not ahead:
            runner.step()
            continue
        if in_flight is None:
            out = scheduler.schedule()
            if not out.scheduled:
                continue
            in_flight = out, runner.execute(out)  # the ranks run outputs in the order they were sent
        following = scheduler.schedule()
        step, in_flight = in_flight, None
        if following.scheduled:
            in_flight = following, runner.execute(following)
        scheduler.update_from_output(*step)
    raise AssertionError("the scheduler did not drain")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_blocks", [14, 200])  # 14: preemption all the time
def test_random_load_ends_as_it_does_one_step_at_a_time(seed: int, num_blocks: int) -> None:
    results = {}
    for k, ahead in ((1, False), (4, False), (3, True), (4, True)):
        scheduler = make_scheduler(k, num_blocks=num_blocks, max_num_seqs=6, budget=24, max_model_len=56)
        runner = MultiStepRunner(scheduler)
        requests = random_requests(seed, 24)
        drive(scheduler, runner, requests, ahead, seed, arrival=0.3 if seed % 2 else 0.06)
        assert all(r.is_finished() for r in requests)
        assert scheduler.block_manager.num_free_blocks == num_blocks
        assert scheduler.num_outstanding_steps == 0 and not scheduler.running
        if k > 1:
            assert max(runner.num_steps_run) == k
        if ahead:
            assert runner.placeholders_seen > 0
        if num_blocks == 14:
            assert sum(r.num_preemptions for r in requests) > 0
        results[k, ahead] = [(r.output_token_ids, r.output_logprobs, r.finish_reason, r.stop_reason)
                             for r in requests]
    assert results[4, False] == results[1, False]
    assert results[3, True] == results[1, False]
    assert results[4, True] == results[1, False]


# ======================================================================= the engine

PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 6], [7] * 12, [3, 1, 4, 1, 5, 9, 2, 6], [11, 12], [8, 3, 8, 3, 8],
           [20, 21, 22, 23]]
EOS_PROMPT, STOP_PROMPT = 3, 4  # PROMPTS[3] stops on the (changed) EOS, PROMPTS[4] on a stop token


def generate(core: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             max_steps: int = 1000) -> list[Any]:
    """EngineCore.generate (final outputs, in prompt order), with a bound on its steps."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    final_only = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
    ids = [core.add_request(p, sp) for p, sp in zip(prompts, final_only)]
    final: dict[str, Any] = {}
    for _ in range(max_steps):
        if len(final) == len(ids):
            return [final[i] for i in ids]
        final.update((out.request_id, out) for out in core.step() if out.finished)
    raise AssertionError(f"not finished after {max_steps} steps")


def _first_new_at(tokens: list[int], indices: list[int]) -> int:
    """The first index in `indices` whose token does not come earlier in `tokens`."""
    for i in indices:
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no new token at {indices} in {tokens}")


@pytest.fixture(scope="module")
def stopping_model(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny llama with its EOS id changed to a token greedy decoding of
    PROMPTS[EOS_PROMPT] makes part-way, and a stop token greedy decoding of
    PROMPTS[STOP_PROMPT] makes part-way. Each first comes at output index 2 mod 4
    (outputs 1-4, 5-8, ... come in one multi-step output each when a request runs with
    nothing arriving): step 2 of 4, so the steps after it are dropped."""
    model = tmp_path_factory.mktemp("multi_step") / "llama_eos"
    shutil.copytree(tiny_models["llama"], model)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with EngineCore(engine_config(model, tp=1)) as core:
        outs = generate(core, [PROMPTS[EOS_PROMPT], PROMPTS[STOP_PROMPT]], greedy)
    eos_tokens, stop_tokens = (o.outputs[0].token_ids for o in outs)
    eos_index = _first_new_at(eos_tokens, [6, 10, 14, 18])
    stop_index = _first_new_at(stop_tokens, [6, 10, 14, 18])
    eos = eos_tokens[eos_index]
    for name in ("config.json", "generation_config.json"):
        path = model / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = eos
            path.write_text(json.dumps(config))
    return {"path": model, "eos": eos, "eos_index": eos_index, "stop": stop_tokens[stop_index],
            "stop_index": stop_index}


def mixed_params(stop: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=21, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=19, temperature=0.8, seed=3, n=2, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0),  # ends on the model's EOS
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop], logprobs=2),
        # Unseeded (the request id's stream), penalties, and EOS held back by min_tokens.
        SamplingParams(max_tokens=14, temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=6),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    ]


def run_mixed(model: Path, tp: int, k: int, stop: int, **overrides: Any
              ) -> tuple[list[Any], list[tuple[int, int]], int]:
    """The mixed requests, the first four at once and the others after two steps; returns
    each request's samples, each step's (last_step_num_steps, last_step_num_tokens) and
    how many preemptions there were."""
    params = mixed_params(stop)
    with EngineCore(engine_config(model, tp=tp, num_scheduler_steps=k, **overrides)) as core:
        assert core.scheduler.num_scheduler_steps == k
        ids = [core.add_request(p, sp) for p, sp in zip(PROMPTS[:4], params[:4])]
        final: dict[str, Any] = {}
        steps: list[tuple[int, int]] = []
        preemptions: dict[str, int] = {}
        while len(final) < len(PROMPTS):
            assert len(steps) < 1000, "the engine did not finish"
            for out in core.step():
                if out.finished:
                    final[out.request_id] = out
            steps.append((core.last_step_num_steps, core.last_step_num_tokens))
            for request in core.scheduler.requests.values():
                preemptions[request.request_id] = request.num_preemptions
            if len(steps) == 2:
                ids += [core.add_request(p, sp) for p, sp in zip(PROMPTS[4:], params[4:])]
    results = [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
                for c in final[i].outputs] for i in ids]
    return results, steps, sum(preemptions.values())


def check_steps(steps: list[tuple[int, int]], k: int) -> None:
    assert all(n <= k for n, _ in steps)
    assert all(tokens % n == 0 for n, tokens in steps if n), steps  # batched tokens x steps
    if k == 1:
        assert {n for n, _ in steps} <= {0, 1}
    else:
        assert any(n > 1 for n, _ in steps), steps  # multi-step outputs ran


def check_stops(results: list[Any], model: dict[str, Any]) -> None:
    """The EOS and stop-token requests stopped where the greedy run makes those tokens."""
    [(tokens, reason, stop_reason, _, _)] = results[EOS_PROMPT]
    assert (len(tokens), tokens[-1], reason, stop_reason) == (model["eos_index"] + 1, model["eos"], "stop", None)
    [(tokens, reason, stop_reason, logprobs, _)] = results[STOP_PROMPT]
    assert (len(tokens), tokens[-1], reason, stop_reason) == (model["stop_index"] + 1, model["stop"], "stop",
                                                              model["stop"])
    assert len(logprobs) == len(tokens) and all(len(entry) >= 2 for entry in logprobs)
    assert len(results[2]) == 2 and results[2][0][0] != results[2][1][0]  # n=2: two different samples
    assert len(results[6][0][0]) == 1


@pytest.mark.parametrize("kv", ["roomy", "tight"])
def test_engine_multi_step_equals_single_step_tp1(stopping_model: dict[str, Any], kv: str) -> None:
    # "tight": 6 blocks of 16 tokens for 8 sequences, so they preempt each other.
    overrides = ({"num_gpu_blocks_override": 6, "kv_cache_memory_bytes": None, "max_model_len": 64,
                  "max_num_batched_tokens": 64} if kv == "tight" else {})
    model, stop = stopping_model["path"], stopping_model["stop"]
    single, single_steps, single_preemptions = run_mixed(model, 1, 1, stop, **overrides)
    multi, multi_steps, multi_preemptions = run_mixed(model, 1, 4, stop, **overrides)
    check_steps(single_steps, 1)
    check_steps(multi_steps, 4)
    check_stops(single, stopping_model)
    assert multi == single
    assert len(multi_steps) < len(single_steps)
    if kv == "tight":
        assert single_preemptions > 0 and multi_preemptions > 0


@pytest.mark.slow
def test_engine_multi_step_equals_single_step_tp2_async(stopping_model: dict[str, Any]) -> None:
    model, stop = stopping_model["path"], stopping_model["stop"]
    single, single_steps, _ = run_mixed(model, 2, 1, stop)
    multi, multi_steps, _ = run_mixed(model, 2, 4, stop)
    check_steps(single_steps, 1)
    check_steps(multi_steps, 4)
    check_stops(single, stopping_model)
    assert multi == single


def test_engine_drops_the_tokens_after_a_stop_inside_a_multi_step_output(stopping_model: dict[str, Any]) -> None:
    """Alone, the EOS and stop-token requests stop at step 2 of a 4-step output: the
    runner made two tokens after each stop, which the engine dropped."""
    model = stopping_model["path"]
    params = [SamplingParams(max_tokens=24, temperature=0, logprobs=1),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stopping_model["stop"]])]
    prompts = [PROMPTS[EOS_PROMPT], PROMPTS[STOP_PROMPT]]
    results = {}
    for k in (1, 4):
        with EngineCore(engine_config(model, tp=1, num_scheduler_steps=k)) as core:
            made: dict[str, list[int]] = {}  # every token the runner made, per request
            update = core.scheduler.update_from_output

            def spy(scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
                for i, req_id in enumerate(runner_output.req_ids):
                    made.setdefault(req_id, []).extend(
                        [runner_output.sampled_token_ids[i], *(step[i] for step in runner_output.later_token_ids)])
                return update(scheduler_output, runner_output)

            core.scheduler.update_from_output = spy  # type: ignore[method-assign]
            outs = generate(core, prompts, params)
        results[k] = [(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for o in outs for c in o.outputs]
        kept = [o.outputs[0].token_ids for o in outs]
        made_per_request = [made[o.request_id] for o in outs]
        if k == 1:
            assert made_per_request == kept
        else:
            for tokens, all_made in zip(kept, made_per_request):
                assert all_made[: len(tokens)] == tokens and len(all_made) == len(tokens) + 2
    assert results[4] == results[1]
    assert results[1][0][:3] == (results[1][0][0], "stop", None) and results[1][0][0][-1] == stopping_model["eos"]
    assert results[1][1][1:3] == ("stop", stopping_model["stop"])


def test_engine_prefix_cache_hits_blocks_that_multi_step_decode_filled(tiny_models: dict[str, Path]) -> None:
    """Blocks filled by the later steps of multi-step outputs are named by their tokens
    like any others: a prompt that continues a finished request's text hits them, and
    its output is what it is one step at a time."""
    first_prompt = [1, 5, 9, 13, 17]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    follow = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    results = {}
    for k, caching in ((1, False), (1, True), (4, True)):
        with EngineCore(engine_config(tiny_models["llama"], tp=1, num_scheduler_steps=k,
                                      enable_prefix_caching=caching)) as core:
            [first] = generate(core, [first_prompt], greedy)
            continued = first_prompt + first.outputs[0].token_ids  # 45 tokens: 2 full blocks of 16
            hits = core.scheduler.block_manager.stats.hits
            [second] = generate(core, [continued], follow)
            assert core.scheduler.block_manager.stats.hits - hits == (32 if caching else 0)
        results[k, caching] = (first.outputs[0].token_ids, second.outputs[0].token_ids,
                               second.outputs[0].logprobs)
    assert results[4, True] == results[1, True]
    assert results[4, True][:2] == results[1, False][:2]


def test_engine_with_stop_strings_matches_and_stays_single_step(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.conftest import tiny_llama_with_tokenizer

    model = tiny_llama_with_tokenizer(tmp_path_factory.mktemp("multi_step_tok") / "tiny", num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=512, init_std=0.1)
    prompt = [5, 17, 99, 204, 33]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with EngineCore(engine_config(model, tp=1)) as core:
        text = generate(core, [prompt], greedy)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    results = {}
    for k in (1, 4):
        with EngineCore(engine_config(model, tp=1, num_scheduler_steps=k)) as core:
            ids = [core.add_request(prompt, sp) for sp in params]
            final: dict[str, Any] = {}
            steps = []
            while len(final) < 2:
                for out in core.step():
                    if out.finished:
                        final[out.request_id] = out
                steps.append((core.last_step_num_steps, ids[0] in final))
        results[k] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for i in ids for c in final[i].outputs]
        # Single steps while the stop-string request runs; then the other one, alone, goes multi.
        assert all(n == 1 for n, stopped in steps if not stopped)
        assert any(n > 1 for n, stopped in steps if stopped) == (k > 1)
    assert results[4] == results[1]
    assert results[1][0][2:] == ("stop", stop) and results[1][1][2] == "length"


# ========================================================================== config


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True, None])
def test_num_scheduler_steps_must_be_an_integer_of_at_least_one(tiny_models: dict[str, Path], bad: Any) -> None:
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        engine_config(tiny_models["llama"], num_scheduler_steps=bad)


def test_num_scheduler_steps_reaches_the_scheduler_config(tiny_models: dict[str, Path]) -> None:
    assert engine_config(tiny_models["llama"]).scheduler_config.num_scheduler_steps == 1
    assert engine_config(tiny_models["llama"], num_scheduler_steps=8).scheduler_config.num_scheduler_steps == 8


# ========================================================================= metrics


def _sample(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not found")


def _generate_with_async_engine(model: Path, k: int, requests: list[tuple[list[int], SamplingParams]]
                                ) -> tuple[list[Any], dict[str, float]]:
    from engine.async_engine import AsyncEngine

    core = EngineCore(engine_config(model, tp=1, num_scheduler_steps=k))
    try:
        engine = AsyncEngine(core, log_stats=False)
    except BaseException:
        core.shutdown()
        raise
    names = ("generation_tokens_total", "iteration_tokens_total_count", "iteration_tokens_total_sum",
             "request_generation_tokens_sum")

    async def collect(prompt: list[int], params: SamplingParams) -> Any:
        last = None
        async for out in engine.generate(prompt, params):
            last = out
        return last

    async def scenario() -> list[Any]:
        return list(await asyncio.gather(*(collect(p, sp) for p, sp in requests)))

    try:
        before = {n: _sample(engine.metrics.render(), PREFIX + n) for n in names}
        finals = asyncio.run(asyncio.wait_for(scenario(), 60))
        after = {n: _sample(engine.metrics.render(), PREFIX + n) for n in names}
    finally:
        engine.shutdown()  # the core's too
    return finals, {n: after[n] - before[n] for n in names}


def test_generation_tokens_metric_counts_every_token_of_a_multi_step_output(tiny_models: dict[str, Path]) -> None:
    prompt = [1, 5, 9, 13, 17]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    [final], grown = _generate_with_async_engine(tiny_models["llama"], 4, [(prompt, params)])
    assert final.finished and len(final.outputs[0].token_ids) == 9
    assert grown["generation_tokens_total"] == 9
    assert grown["request_generation_tokens_sum"] == 9
    # Three outputs ran: the prefill (one token), then 4 + 4 decode steps; each counts
    # its batched tokens times its steps.
    assert grown["iteration_tokens_total_count"] == 3
    assert grown["iteration_tokens_total_sum"] == len(prompt) + 4 + 4


def test_generation_tokens_metric_with_several_requests(tiny_models: dict[str, Path]) -> None:
    requests = [([1, 5, 9, 13, 17], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)),
                ([2, 4, 6], SamplingParams(max_tokens=6, temperature=0.7, seed=1, ignore_eos=True)),
                ([7] * 12, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True))]
    finals, grown = _generate_with_async_engine(tiny_models["llama"], 4, requests)
    assert [len(f.outputs[0].token_ids) for f in finals] == [9, 6, 13]
    assert grown["generation_tokens_total"] == 9 + 6 + 13
    assert grown["request_generation_tokens_sum"] == 9 + 6 + 13


@pytest.mark.parametrize("k", [1, 4])
def test_generation_tokens_metric_with_delta_outputs(tiny_models: dict[str, Path], k: int) -> None:
    """A DELTA request's outputs hold only the new tokens; the metric still counts them all."""
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    [final], grown = _generate_with_async_engine(tiny_models["llama"], k, [([1, 5, 9, 13, 17], params)])
    assert final.finished
    assert grown["generation_tokens_total"] == 9
    assert grown["request_generation_tokens_sum"] == 9


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_generation_tokens_metric_counts_every_sample_of_n(tiny_models: dict[str, Path], kind) -> None:
    """n = 3 samples of 7 tokens each are 21 generated tokens, whatever the output kind;
    the request's own histogram keeps the first sample's count (one request, one
    timeline)."""
    params = SamplingParams(n=3, max_tokens=7, temperature=0.8, seed=3, ignore_eos=True, output_kind=kind)
    [final], grown = _generate_with_async_engine(tiny_models["llama"], 1, [([1, 5, 9, 13, 17], params)])
    assert final.finished and len(final.outputs) == 3
    assert grown["generation_tokens_total"] == 21
    assert grown["request_generation_tokens_sum"] == 7
