"""The wire format of executor/serial_utils.py: a step's messages and the RPC envelope are
MessagePack end to end and come back exactly (every field, nested requests, sampling
params with every option set, logprobs, prompt logprobs, multi-step, empty batches);
what a call carries keeps today's path (pickle) and its exact types; a tensor or
callable RPC still works on real worker processes; bytes that are no message fail at
once with MessageDecodeError, and a worker that gets one dies loudly instead of leaving
the engine waiting."""

from __future__ import annotations

import logging
import math
import pickle
import time

import msgspec
import pytest
import torch

from config import RequestOutputKind, SamplingParams
from engine.core import EngineCore
from executor import message_queue_writer
from executor.errors import EngineDeadError
from executor.message_queue import MessageQueueOwner
from executor.message_queue_reader import MessageQueueReader
from executor.message_queue_writer import MessageQueueWriter
from executor.rpc import RPCReply, RPCRequest
from executor.serial_utils import MessageDecodeError, decode_message, encode_message
from tests import test_engine_runtime
from tests.runtime_helpers import engine_config
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput

pytestmark = pytest.mark.timeout(300)


def every_option() -> SamplingParams:
    """SamplingParams with every field away from its default (temperature below 0.01:
    its construction warns and raises it to 0.01)."""
    return SamplingParams(
        n=2, best_of=3, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3, temperature=0.005,
        top_p=0.9, top_k=7, min_p=0.05, seed=1234, stop=["\n\n", "END"], stop_token_ids=[2, 11],
        include_stop_str_in_output=True, ignore_eos=True, max_tokens=40, min_tokens=3, logprobs=4, prompt_logprobs=2,
        logit_bias={5: 250.0, 9: -1.5}, allowed_token_ids=[1, 2, 5, 9, 11], bad_words=["bad word"],
        skip_special_tokens=False, detokenize=True, truncate_prompt_tokens=64, truncation_side="right",
        output_kind=RequestOutputKind.DELTA, bad_words_token_ids=[[7, 8]], all_stop_token_ids=[2, 11, 99],
    )


def decode_step(n: int = 32) -> SchedulerOutput:
    return SchedulerOutput([ScheduledRequest(f"cmpl-{i}", [PLACEHOLDER_TOKEN_ID], 600 + i, list(range(i, i + 40)),
                                             True, None, 90 + i) for i in range(n)], ["done-1", "done-2"], n)


def admission_step() -> SchedulerOutput:
    return SchedulerOutput([
        ScheduledRequest("new", list(range(30)), 0, [4, 5], True, every_option(), 0, history=(list(range(30)), [])),
        ScheduledRequest("plain", [3, 4], 16, [1, 2], False, SamplingParams(), 0),
        ScheduledRequest("running", [8], 41, [0, 6, 2], True, None, 12),
    ], [], 33, num_steps=1)


def runner_outputs() -> dict[str, ModelRunnerOutput]:
    ids = ["a", "b", "c"]
    top = [{17: -0.25, 3: -1.5}, None, {5: -math.inf, 6: -0.0}]
    return {
        "tokens only": ModelRunnerOutput(ids, [17, 4, 5], [None, None, None]),
        "logprobs and prompt logprobs": ModelRunnerOutput(
            ids, [17, 4, 5], top, {"a": (1, [{6: -0.5}, {7: -2.0, 8: -0.125}], [2, 1]), "c": (4, [], [])}),
        "multi-step": ModelRunnerOutput(ids, [1, 2, 3], top, later_token_ids=[[4, 5, 6], [7, 8, 9]],
                                        later_logprobs=[top, [None, None, None]]),
        "empty": ModelRunnerOutput([], [], []),
    }


STEPS = {"decode": decode_step(), "admission": admission_step(), "empty": SchedulerOutput([], ["gone"], 0)}


def assert_same(copy: object, message: object) -> None:
    """Equal, of the same type, field by field, nested structs and params included."""
    assert type(copy) is type(message)
    assert copy == message
    if isinstance(message, msgspec.Struct):
        for f in msgspec.structs.fields(message):
            assert_same(getattr(copy, f.name), getattr(message, f.name))
    elif isinstance(message, (list, tuple)):
        for got, want in zip(copy, message):
            assert_same(got, want)
    elif isinstance(message, SamplingParams):
        assert vars(copy) == vars(message)
        assert type(copy.output_kind) is RequestOutputKind


@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_a_step_request_round_trips_exactly(step):
    assert_same(decode_message(encode_message(step)), step)
    request = RPCRequest(41, "execute_model", (step,), {}, 0, 40)
    assert_same(decode_message(encode_message(request)), request)


@pytest.mark.parametrize("output", runner_outputs().values(), ids=runner_outputs().keys())
def test_a_step_reply_round_trips_exactly(output):
    assert_same(decode_message(encode_message(output)), output)
    reply = RPCReply(41, 0, True, result=output)
    assert_same(decode_message(encode_message(reply)), reply)


def test_a_step_and_its_reply_use_no_pickle(monkeypatch):
    request = RPCRequest(7, "execute_model", (admission_step(),), {}, 0, None)
    reply = RPCReply(7, 0, True, result=runner_outputs()["logprobs and prompt logprobs"])
    encoded = [encode_message(request), encode_message(reply)]

    def no_pickle(*args, **kwargs):
        raise AssertionError("a step's messages must not be pickled")

    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    assert [decode_message(encode_message(m)) for m in (request, reply)] == [request, reply]
    assert [decode_message(b) for b in encoded] == [request, reply]


def test_sampling_params_cross_equal_without_their_checks_running_again(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="config.sampling_params"):
        step = admission_step()
    assert any("below" in r.getMessage() for r in caplog.records), "construction warns, once"
    caplog.clear()
    checks: list[SamplingParams] = []
    monkeypatch.setattr(SamplingParams, "__post_init__", lambda self: checks.append(self))
    with caplog.at_level(logging.DEBUG):
        copy = decode_message(encode_message(step))
    assert_same(copy, step)
    assert copy.scheduled[0].sampling_params.temperature == 0.01
    assert checks == [] and caplog.records == []


class CustomParams(SamplingParams):
    """A user's subclass: the field order of SamplingParams does not describe it."""


def test_a_subclass_of_sampling_params_crosses_as_itself():
    step = SchedulerOutput([ScheduledRequest("x", [1], 0, [0], True, CustomParams(max_tokens=3), 0)], [], 1)
    assert_same(decode_message(encode_message(step)), step)


def test_a_call_s_values_keep_their_exact_types():
    values = (None, True, 3, -(1 << 63), (1 << 64) - 1, 1 << 70, 2.5, "text", b"\x00bytes", (1, (2, 3)), [1, [2]],
              {1, 2}, {(1, 2): "tuple key"}, torch.arange(6).reshape(2, 3), ValueError("kept"), every_option())
    request = RPCRequest(3, b"cloudpickled fn", values, {"scale": torch.ones(2), "flag": False, "step": decode_step(2)})
    copy = decode_message(encode_message(request))
    assert type(copy.method) is bytes and copy.method == b"cloudpickled fn"
    for got, want in zip(copy.args, values):
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        elif isinstance(want, Exception):
            assert got.args == want.args
        else:
            assert got == want
    assert torch.equal(copy.kwargs["scale"], torch.ones(2)) and copy.kwargs["flag"] is False
    assert_same(copy.kwargs["step"], decode_step(2))
    error = RPCReply(3, 1, False, error="ValueError: boom", traceback="Traceback (most recent call last):\n ...")
    assert_same(decode_message(encode_message(error)), error)
    assert request.args is values, "encoding never modifies the caller's message"


def test_a_value_that_does_not_pickle_raises_in_the_encoder():
    import threading

    with pytest.raises(TypeError, match="pickle"):
        encode_message(RPCReply(1, 0, True, result=threading.Lock()))


@pytest.mark.parametrize("garbage,says", [
    (b"", "empty message"),
    (b"\x07\x00\x01", "unknown message tag 0x07"),
    (b"\x01\x96\x01", "RPCRequest of 3 bytes does not decode: DecodeError"),
    (b"\x02" + msgspec.msgpack.encode(["not an id", 0, True, None, None, None]), "RPCReply.*ValidationError"),
    (b"\x02" + msgspec.msgpack.encode([1, 0, True, msgspec.msgpack.Ext(9, b"?"), None, None]), "unknown ext code 9"),
    (b"\x02" + msgspec.msgpack.encode([1, 0, True, msgspec.msgpack.Ext(127, b"\x80\x05junk"), None, None]),
     "does not decode: UnpicklingError"),
    (b"\x80\x05\x95garbage", "pickled message of 10 bytes does not unpickle"),
])
def test_bytes_that_are_no_message_fail_with_a_clear_error(garbage, says):
    with pytest.raises(MessageDecodeError, match=says):
        decode_message(garbage)


def test_a_garbled_chunk_fails_its_reader_at_once_and_the_queue_goes_on(monkeypatch):
    owner = MessageQueueOwner(1)
    writer = MessageQueueWriter(owner.export_handle())
    reader = MessageQueueReader(owner.export_handle(), 0)
    try:
        writer.wait_until_ready(timeout=10)
        monkeypatch.setattr(message_queue_writer, "encode_message", lambda message: b"\x09not a message")
        writer.enqueue("anything", timeout=10)
        monkeypatch.undo()
        writer.enqueue(RPCRequest(2, "check_health"), timeout=10)
        start = time.monotonic()
        with pytest.raises(MessageDecodeError, match="unknown message tag 0x09"):
            reader.dequeue(timeout=30)
        assert time.monotonic() - start < 5
        assert reader.dequeue(timeout=10) == RPCRequest(2, "check_health")
    finally:
        for endpoint in (reader, writer):
            endpoint.shutdown()
        owner.shutdown()


# ---------------------------------------------------------------- real worker processes

engine_tp2 = test_engine_runtime.engine_tp2  # its fixture: one TP=2 engine for the module's tests


def scale_on_rank(worker, data: torch.Tensor, *, factor: torch.Tensor) -> tuple[int, torch.Tensor]:
    return worker.rank, data * factor


@pytest.mark.slow
def test_a_callable_with_tensors_runs_on_every_rank(engine_tp2):
    data = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    results = engine_tp2.collective_rpc(scale_on_rank, args=(data,), kwargs={"factor": torch.tensor(2.0)})
    assert [rank for rank, _ in results] == [0, 1]
    assert all(torch.equal(t, data * 2) for _, t in results)
    assert engine_tp2.collective_rpc(lambda w, xs: (type(xs).__name__, xs), args=((1, {2}),)) == [("tuple", (1, {2}))] * 2


def test_steps_cross_to_the_ranks_and_back(engine_tp2):
    """Admission with params and history, decode steps, logprobs and prompt logprobs
    coming back: the whole step path through the mp executor."""
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True, prompt_logprobs=1,
                             repetition_penalty=1.2)]
    greedy, sampled = engine_tp2.generate([[1, 17, 42], [250, 4, 8, 15]], params)
    assert len(greedy.token_ids) == 5 and len(sampled.token_ids) == 4
    assert all(t in lp and len(lp) <= 3 for t, lp in zip(greedy.token_ids, greedy.logprobs))
    assert len(sampled.prompt_logprobs) == 4 and sampled.prompt_logprobs[0] is None


@pytest.mark.slow
def test_a_worker_that_gets_a_garbled_request_dies_and_the_engine_says_so(tiny_models, monkeypatch):
    with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
        encode = message_queue_writer.encode_message

        def garble_health_checks(message):
            if isinstance(message, RPCRequest) and message.method == "check_health":
                return b"\x0agarbled"
            return encode(message)

        monkeypatch.setattr(message_queue_writer, "encode_message", garble_health_checks)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank \d .* died unexpectedly with exit code 1"):
            core.collective_rpc("check_health", timeout=120)
        assert time.monotonic() - start < 60
