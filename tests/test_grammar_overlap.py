"""A step's grammar bitmask filled while the ranks run its forward (structured outputs).

With an executor that takes a step's bitmask after the step (`supports_grammar_overlap`:
the mp executor), the scheduler plans a constrained request's steps without their mask
(`grammar_follows`), also behind a step still in flight (async scheduling), and the
engine fills the mask once the step before it is applied, while the ranks already run
the forward; each rank reads it just before sampling.

Two levels. Against the scheduler, a grammar that allows exactly one token next, and a
stand-in runner that samples whatever the mask allows: every token must obey the mask
the engine filled after the previous token was applied, and a constrained request is
planned behind its own step in flight. Against the engine, TP=2 on worker processes:
the ranks are inside the step before its mask exists; greedy tokens equal those of the
same engine filling masks at scheduling time; a failure to fill a mask fails that step
and the engine goes on serving.
"""

from __future__ import annotations

import time

import pytest
import torch

from config import SamplingParams
from engine.block_manager import KVBlockManager
from engine.core import EngineCore
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.structured_output import StructuredOutputRequest
from engine.structured_output.backend_types import StructuredOutputGrammar
from executor.liveness import BUSY_CALL
from executor.multiproc_executor import MultiprocExecutor
from tests.runtime_helpers import engine_config
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput

VOCAB = 64


class CountingGrammar(StructuredOutputGrammar):
    """Allows exactly one token next: 3, 4, ..., 12, 3, ... (by tokens accepted)."""

    def __init__(self) -> None:
        self.accepted = 0

    def allowed(self) -> int:
        return 3 + self.accepted % 10

    def accept_token(self, token_id: int) -> bool:
        if token_id != self.allowed():
            return False
        self.accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        token = self.allowed()
        bitmask[row] = 0
        bitmask[row, token // 32] = 1 << (token % 32)

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        self.accepted = 0


class Backend:
    vocab_size = VOCAB

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows, (VOCAB + 31) // 32), -1, dtype=torch.int32)


def masked_runner(out: SchedulerOutput, bitmask: bytes | None) -> ModelRunnerOutput:
    """Samples, for each constrained row, the lowest token its mask allows (a free
    request samples token 40)."""
    rows = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(-1, (VOCAB + 31) // 32) if bitmask else None
    row_of = {req_id: i for i, req_id in enumerate(out.structured_output_req_ids)}
    req_ids, tokens = [], []
    for s in out.scheduled:
        if s.sample:
            token = 40
            if s.req_id in row_of:
                bits = rows[row_of[s.req_id]]
                token = next(t for t in range(VOCAB) if int(bits[t // 32]) >> (t % 32) & 1)
            req_ids.append(s.req_id)
            tokens.append(token)
    return ModelRunnerOutput(req_ids, tokens, [None] * len(tokens))


def constrained(request_id: str, **params) -> Request:
    request = Request(request_id, [7, 8, 9], SamplingParams(**params))
    request.structured_output_request = StructuredOutputRequest(Backend(), CountingGrammar())
    return request


def make_scheduler(defer_grammar: bool) -> Scheduler:
    return Scheduler(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                     block_manager=KVBlockManager(32, 4), eos_token_id=2, defer_grammar=defer_grammar)


def test_deferred_masks_follow_each_applied_token_and_are_planned_ahead():
    """Planned one step ahead: each constrained step is planned behind its own step in
    flight, its mask made once that step is applied, and every token obeys its mask."""
    scheduler = make_scheduler(defer_grammar=True)
    requests = [constrained("a", max_tokens=12, ignore_eos=True), constrained("b", max_tokens=7, ignore_eos=True),
                Request("free", [5, 6], SamplingParams(max_tokens=5, ignore_eos=True))]
    for r in requests:
        scheduler.add_request(r)
    first = scheduler.schedule()
    assert first.grammar_follows and first.grammar_bitmask is None
    assert first.structured_output_req_ids == ["a", "b"]
    in_flight = first, scheduler.grammar_bitmask(first)  # nothing outstanding before it
    planned_behind = 0
    while True:
        following = scheduler.schedule()
        for s in following.scheduled:
            if s.req_id in following.structured_output_req_ids and s.token_ids == [PLACEHOLDER_TOKEN_ID]:
                planned_behind += 1  # behind its own step in flight, as a free request is
        out, bitmask = in_flight
        scheduler.update_from_output(out, masked_runner(out, bitmask))
        if not following.scheduled:
            break
        in_flight = following, scheduler.grammar_bitmask(following) if following.grammar_follows else None
    assert [r.output_token_ids for r in requests[:2]] == [[3 + i % 10 for i in range(12)], [3 + i for i in range(7)]]
    assert requests[2].output_token_ids == [40] * 5
    assert planned_behind == 11 + 6  # every decode step of both
    assert scheduler.num_outstanding_steps == 0 and not scheduler.running


def test_without_deferral_a_constrained_request_waits_for_its_step_in_flight():
    """The scheduling-time mask needs the previous token: no constrained step is planned
    behind one in flight (the behaviour executors without the overlap keep)."""
    scheduler = make_scheduler(defer_grammar=False)
    scheduler.add_request(constrained("a", max_tokens=6, ignore_eos=True))
    first = scheduler.schedule()
    assert first.grammar_bitmask is not None and not first.grammar_follows
    assert not scheduler.schedule().scheduled


def test_a_sample_that_ended_behind_its_planned_step_gets_an_all_allowed_row():
    """A stop token applied after the next step was planned: that step's row allows
    everything (its token is dropped), the other rows are their grammars'."""
    scheduler = make_scheduler(defer_grammar=True)
    ending, going = constrained("ending", max_tokens=20, stop_token_ids=[4]), constrained("going", max_tokens=20)
    scheduler.add_request(ending)
    scheduler.add_request(going)
    first = scheduler.schedule()
    scheduler.update_from_output(first, masked_runner(first, scheduler.grammar_bitmask(first)))  # token 3 each
    second = scheduler.schedule()
    third = scheduler.schedule()  # planned behind `second`, which samples the stop token 4
    scheduler.update_from_output(second, masked_runner(second, scheduler.grammar_bitmask(second)))
    assert ending.status == RequestStatus.FINISHED_STOPPED
    rows = torch.frombuffer(bytearray(scheduler.grammar_bitmask(third)), dtype=torch.int32).view(2, -1)
    assert third.structured_output_req_ids == ["ending", "going"]
    assert (rows[0] == -1).all()
    assert rows[1].tolist() == [1 << 5, 0]  # "going" has 3, 4: 5 comes next
    scheduler.update_from_output(third, masked_runner(third, scheduler.grammar_bitmask(third)))
    assert going.output_token_ids == [3, 4, 5] and ending.output_token_ids == [3, 4]


# ------------------------------------------------------------------ the engine, TP=2 on worker processes


class MaskAtSchedulingExecutor(MultiprocExecutor):
    """The mp executor without the overlap: masks filled when steps are planned."""

    supports_grammar_overlap = False


PROMPTS = ["Hello, world!", "The capital of France", "numbers 0 1 2", "Once upon a time"]


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"regex": "[a-z ]{4,20}"}),
            SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"choice": ["yes", "no", "maybe so"]}),
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=1.0, seed=3, structured_outputs={"regex": "[0-9]{3,9}"})]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_ranks_start_the_step_before_its_mask_exists_and_tokens_match(serve_model, async_scheduling):
    """Each mask is filled while every rank is already inside its step (filling waits
    for them: with the mask needed first, it would wait forever); tokens equal those of
    masks filled at scheduling time."""
    config = engine_config(serve_model, tp=2, async_scheduling=async_scheduling)
    with EngineCore(config) as core:
        executor = core.model_executor
        assert isinstance(executor, MultiprocExecutor) and core.scheduler.defer_grammar
        futures: dict[int, object] = {}
        execute = executor.execute_model

        def recording_execute(output, non_block=False):
            result = execute(output, non_block=non_block)
            futures[id(output)] = result
            return result

        fill = core.scheduler.grammar_bitmask
        filled_inside = []

        def fill_once_ranks_are_in_the_step(output):
            call_id = futures[id(output)].call.call_id
            deadline = time.monotonic() + 60
            while any(executor._board.row(r)[BUSY_CALL] != call_id for r in range(2)):
                assert time.monotonic() < deadline, "the ranks never started the step without its mask"
                time.sleep(0.001)
            filled_inside.append(call_id)
            return fill(output)

        executor.execute_model = recording_execute
        core.scheduler.grammar_bitmask = fill_once_ranks_are_in_the_step
        overlapped = core.generate(PROMPTS, mixed_params())
        assert len(filled_inside) >= 10
    with EngineCore(engine_config(serve_model, tp=2, async_scheduling=async_scheduling,
                                  distributed_executor_backend=MaskAtSchedulingExecutor)) as core:
        assert not core.scheduler.defer_grammar
        at_scheduling = core.generate(PROMPTS, mixed_params())
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in at_scheduling]
    assert overlapped[1].outputs[0].text in ("yes", "no", "maybe so")


@pytest.mark.slow
@pytest.mark.parametrize(("async_scheduling", "failing_fill"), [(True, 1), (True, 3), (False, 3)])
def test_a_mask_that_cannot_be_filled_fails_its_step_and_the_engine_goes_on(serve_model, async_scheduling,
                                                                            failing_fill):
    """The error reaches the caller; the ranks, waiting for the mask, fail the step
    instead of hanging; no worker is replaced and the next requests are served. (The
    first fill of an async run is made before any step is applied, later ones after.)"""
    with EngineCore(engine_config(serve_model, tp=2, max_worker_restarts=0,
                                  async_scheduling=async_scheduling)) as core:
        fill = core.scheduler.grammar_bitmask
        calls = []

        def broken(output):
            calls.append(output)
            if len(calls) == failing_fill:
                raise ValueError("grammar state lost")
            return fill(output)

        core.scheduler.grammar_bitmask = broken
        with pytest.raises(ValueError, match="grammar state lost"):
            core.generate(PROMPTS[:2], mixed_params()[:2])
        core.scheduler.grammar_bitmask = fill
        core.check_health()
        outputs = core.generate(PROMPTS, mixed_params())
        assert outputs[1].outputs[0].text in ("yes", "no", "maybe so")
        assert core.num_worker_restarts == 0
