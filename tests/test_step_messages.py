"""The step's messages (worker/outputs.py) survive the trip to the ranks and back whole:
every field, set to a value other than its default, comes out of pickle equal, through
the shared-memory queue the multiproc executor sends them on."""

from __future__ import annotations

import pickle
from dataclasses import fields

import pytest

from engine.sampling_params import SamplingParams
from executor.message_queue import MessageQueueOwner
from executor.message_queue_reader import MessageQueueReader
from executor.message_queue_writer import MessageQueueWriter
from worker.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput


def _messages() -> list[object]:
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, logprobs=2)
    first = ScheduledRequest("req-a", [5, 6, 7], 0, [3, 9], True, params, 0, history=([5, 6, 7], []))
    later = ScheduledRequest("req-b", [PLACEHOLDER_TOKEN_ID], 41, [1, 2, 4], False, None, 12)
    return [
        first,
        later,
        SchedulerOutput([first, later], ["req-gone"], 4),
        ModelRunnerOutput(["req-a"], [17], [{17: -0.25, 3: -1.5}], {"req-a": (1, [{6: -0.5}], [2])}),
    ]


@pytest.mark.parametrize("message", _messages(), ids=lambda m: type(m).__name__)
def test_every_field_round_trips(message):
    copy = pickle.loads(pickle.dumps(message, protocol=5))
    assert type(copy) is type(message)
    for f in fields(message):
        assert getattr(copy, f.name) == getattr(message, f.name), f.name
    # __reduce__ hands the constructor every field: one added later cannot be dropped.
    assert len(message.__reduce__()[1]) == len(fields(message))


def test_a_step_crosses_the_queue():
    owner = MessageQueueOwner(2)
    writer = MessageQueueWriter(owner.export_handle())
    readers = [MessageQueueReader(owner.export_handle(), r) for r in range(2)]
    try:
        writer.wait_until_ready(timeout=10)
        step = _messages()[2]
        writer.enqueue(step)
        for reader in readers:
            assert reader.dequeue(timeout=10) == step
    finally:
        for endpoint in (*readers, writer):
            endpoint.shutdown()
        owner.shutdown()
