"""The step's messages (worker/outputs.py) survive the trip to the ranks and back whole:
every field, set to a value other than its default, comes out of pickle equal, through
the shared-memory queue the multiproc executor sends them on."""

from __future__ import annotations

import pickle

import pytest
from msgspec.structs import fields

from config import SamplingParams
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


def test_a_step_becomes_the_model_s_inputs_on_a_rank(tiny_models):
    """What ModelRunner._prepare_inputs makes of a step with requests of different
    lengths and block tables: the token rows, their positions and cache slots, the
    block tables padded to the longest with block 0, and the rows that sample."""
    import torch

    from engine.arg_utils import create_engine_config
    from worker.kv_cache import KVCacheConfig
    from worker.model_runner import ModelRunner

    config = create_engine_config(model=str(tiny_models["llama"]), device="cpu", dtype="float32", use_tqdm_on_load=False)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(KVCacheConfig.from_spec(runner.get_kv_cache_spec(), 16))
    bs = runner.kv_cache_config.block_size
    params = SamplingParams()
    step = SchedulerOutput([
        ScheduledRequest("chunk", [11, 12, 13], bs - 1, [7, 2], False, params, 0),  # crosses a block edge
        ScheduledRequest("decode", [21], 2 * bs + 1, [5, 1, 3], True, params, 4),
        ScheduledRequest("prefill", [31, 32], 0, [9], True, params, 0),
    ], [], 6)
    ids, positions, md, sample_rows = runner._prepare_inputs(step)

    want_positions = [bs - 1, bs, bs + 1, 2 * bs + 1, 0, 1]
    tables = [[7, 2], [5, 1, 3], [9]]
    owner = [0, 0, 0, 1, 2, 2]
    assert ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert positions.tolist() == want_positions
    assert md.slot_mapping.tolist() == [tables[r][p // bs] * bs + p % bs for r, p in zip(owner, want_positions)]
    assert md.block_tables.dtype == torch.long
    assert md.block_tables.tolist() == [[7, 2, 0], [5, 1, 3], [9, 0, 0]]
    assert list(md.seq_lens) == [bs + 2, 2 * bs + 2, 2]
    assert list(md.query_start_loc) == [0, 3, 4, 6]
    assert sample_rows == [3, 5]
