"""The decode context a layer keeps across steps (models/layers/decode_context.py).

A simulated serving run drives one Attention layer over a real paged cache: prompts
prefilled (some in chunks), long decode runs whose lengths pass the buffer's capacity
again and again, a sequence leaving, one joining in a mixed prefill + decode step, one
coming back under a new key (preempted and recomputed), and a budget too small for the
buffer. At every step the output with sequence keys (buffer path) must equal the output
without (the per-step gather), and the buffer must be reused exactly when the batch
continues the previous step. The runner must split the memory budget among the layers
and change a request's key when its id is reused or it is preempted.
"""

from __future__ import annotations

import pytest
import torch

import models.layers.decode_context as decode_context
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from models.layers.attention import Attention, AttentionMetadata

HEADS, KV_HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 256


class Sim:
    """Sequences with block tables over one cache; builds each step's metadata."""

    def __init__(self) -> None:
        self.cache = torch.zeros(NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD_SIZE)
        self.free = list(range(NUM_BLOCKS - 1, -1, -1))
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.keys: dict[str, int] = {}
        self.next_key = 0
        self.gen = torch.Generator().manual_seed(0)

    def new_key(self, name: str) -> None:
        self.keys[name] = self.next_key
        self.next_key += 1

    def add(self, name: str) -> None:
        self.blocks[name], self.lens[name] = [], 0
        self.new_key(name)

    def remove(self, name: str) -> None:
        self.free.extend(self.blocks.pop(name))
        del self.lens[name], self.keys[name]

    def step(self, chunks: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, AttentionMetadata]:
        """Schedule `chunks` {name: new tokens}; return q, k, v and the metadata with and without keys."""
        slots, seq_lens, qsl, keys = [], [], [0], []
        for name, n in chunks.items():
            start = self.lens[name]
            while len(self.blocks[name]) * BLOCK < start + n:
                self.blocks[name].append(self.free.pop())
            slots += [self.blocks[name][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
            self.lens[name] = start + n
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            keys.append(self.keys[name])
        width = max(len(self.blocks[name]) for name in chunks)
        tables = torch.full((len(chunks), width), -1, dtype=torch.long)
        for i, name in enumerate(chunks):
            tables[i, : len(self.blocks[name])] = torch.tensor(self.blocks[name])
        common = dict(slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=seq_lens,
                      query_start_loc=qsl, block_size=BLOCK)
        total = qsl[-1]
        q = torch.randn(total, HEADS * HEAD_SIZE, generator=self.gen)
        k = torch.randn(total, KV_HEADS * HEAD_SIZE, generator=self.gen)
        v = torch.randn(total, KV_HEADS * HEAD_SIZE, generator=self.gen)
        return q, k, v, AttentionMetadata(**common, seq_keys=tuple(keys)), AttentionMetadata(**common)


def run_step(attn: Attention, sim: Sim, chunks: dict[str, int]) -> bool:
    """One step both ways; asserts equal outputs; returns whether the buffer was reused."""
    q, k, v, keyed, plain = sim.step(chunks)
    before = attn.decode_context.buffer
    before_lens = attn.decode_context.lens
    expected = attn(q, k, v, plain)
    got = attn(q, k, v, keyed)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    reused = before is not None and attn.decode_context.buffer is before and before_lens == keyed.decode_prev_lens
    return reused


def test_buffer_path_equals_per_step_gather_through_a_serving_run(monkeypatch):
    monkeypatch.setattr(decode_context, "_GROWTH", 4)  # outgrow the buffer every few steps
    sim = Sim()
    attn = Attention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
    attn.kv_cache = sim.cache
    for name in "abc":
        sim.add(name)
    run_step(attn, sim, {"a": 5, "b": 9})  # whole prompts
    run_step(attn, sim, {"a": 1, "b": 1, "c": 3})  # decodes and a prompt in one step
    reuses = [run_step(attn, sim, {"a": 1, "b": 1, "c": 1}) for _ in range(30)]
    assert reuses[0] is False and sum(reuses) >= 20  # rebuilt when the batch changed or outgrew the buffer
    sim.remove("c")  # finished
    assert run_step(attn, sim, {"a": 1, "b": 1}) is False
    sim.add("d")
    run_step(attn, sim, {"a": 1, "b": 1, "d": 6})  # d prefilled in two chunks while a, b decode
    run_step(attn, sim, {"a": 1, "b": 1, "d": 7})
    assert run_step(attn, sim, {"a": 1, "b": 1, "d": 1}) is False
    assert run_step(attn, sim, {"a": 1, "b": 1, "d": 1}) is True
    sim.new_key("b")  # b preempted and recomputed: same content, new key
    assert run_step(attn, sim, {"a": 1, "b": 1, "d": 1}) is False
    for _ in range(10):
        run_step(attn, sim, {"a": 1, "b": 1, "d": 1})
    # A budget too small for the batch: at the next rebuild the layer drops the buffer
    # and gathers per step.
    attn.decode_context.max_bytes = 1024
    sim.new_key("a")
    run_step(attn, sim, {"a": 1, "b": 1, "d": 1})
    assert attn.decode_context.buffer is None
    run_step(attn, sim, {"a": 1, "b": 1, "d": 1})


def test_runner_shares_the_budget_and_renews_keys_of_reused_or_preempted_requests(tiny_models):
    from engine.config import EngineConfig
    from worker.model_runner import ModelRunner

    config = EngineConfig(model=str(tiny_models["llama"]), device="cpu", dtype="float32", use_tqdm_on_load=False)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()

    def scheduled(req_id: str) -> ScheduledRequest:
        return ScheduledRequest(req_id, [5], 3, [0], True, SamplingParams(), 0)

    from worker.kv_cache import kv_cache_config_for

    runner.initialize_kv_cache(kv_cache_config_for(config, 8))
    layers = runner.model.attention_layers()
    assert all(a.decode_context.max_bytes == decode_context.TOTAL_BYTES // len(layers) for a in layers)

    first = runner._update_seq_keys(SchedulerOutput([scheduled("x"), scheduled("y")], [], 2))
    again = runner._update_seq_keys(SchedulerOutput([scheduled("x"), scheduled("y")], [], 2))
    assert first == again and len(set(first)) == 2
    # "x" finished (or was preempted) and an "x" is scheduled again: it must not match.
    after = runner._update_seq_keys(SchedulerOutput([scheduled("x"), scheduled("y")], ["x"], 2))
    assert after[1] == first[1] and after[0] not in first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_mask_matches_query_dtype(dtype):
    md = AttentionMetadata(slot_mapping=torch.tensor([0, 1]), block_tables=torch.tensor([[0], [1]]),
                           seq_lens=[3, 1], query_start_loc=[0, 1, 2], block_size=4, seq_keys=(0, 1))
    mask = md.decode_mask(dtype)
    assert mask.dtype == dtype and mask.shape == (1, 2, 1, 3)
    assert mask[0, 0, 0].tolist() == [0, 0, 0] and mask[0, 1, 0, 1:].isinf().all()
