"""The decode context the CPU attention backend keeps per layer across steps
(models/layers/attention/backends/decode_context.py, cpu_attn.py).

A simulated serving run drives one Attention layer over a real paged cache: prompts
prefilled (some in chunks), long decode runs whose lengths pass the buffer's capacity
again and again, a sequence leaving, one joining in a mixed prefill + decode step, one
coming back under a new key (preempted and recomputed), and a budget too small for the
buffer. At every step the CPU backend's output (buffer path) must equal the SDPA
backend's (the per-step gather), and the buffer must be reused exactly when the batch
continues the previous step. The backend must split the memory budget among the layers
and change a request's key when its id is reused or it is preempted.
"""

from __future__ import annotations

import pytest
import torch

import models.layers.attention.backends.decode_context as decode_context
from config import SamplingParams
from models.layers.attention import Attention, AttentionMetadata
from models.layers.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl, CPUAttentionMetadata
from models.layers.attention.backends.torch_sdpa import TorchSDPABackend
from worker.outputs import ScheduledRequest, SchedulerOutput

HEADS, KV_HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 256


class Sim:
    """Sequences with block tables over one cache, and one Attention layer bound to it
    through each backend: `keyed` (CPU, decode context) and `plain` (SDPA, gather)."""

    def __init__(self) -> None:
        self.cache = torch.zeros(NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD_SIZE)
        self.free = list(range(NUM_BLOCKS - 1, -1, -1))
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.cpu_backend, self.sdpa_backend = CPUAttentionBackend(num_layers=1, paged_decode=False), TorchSDPABackend()
        self.keyed = Attention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
        self.keyed.bind_kv_cache(self.cache, self.cpu_backend.make_impl(self.keyed))
        self.plain = Attention(HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, KV_HEADS)
        self.plain.bind_kv_cache(self.cache, self.sdpa_backend.make_impl(self.plain))

    @property
    def decode_context(self) -> decode_context.DecodeContext:
        impl = self.keyed.impl
        assert isinstance(impl, CPUAttentionImpl)
        return impl.decode_context

    def new_key(self, name: str) -> None:
        """`name` was preempted: the backend hears it finished; it is recomputed under its id."""
        self.cpu_backend.requests_finished([name])

    def add(self, name: str) -> None:
        self.blocks[name], self.lens[name] = [], 0

    def remove(self, name: str) -> None:
        self.free.extend(self.blocks.pop(name))
        del self.lens[name]
        self.cpu_backend.requests_finished([name])

    def step(self, chunks: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Schedule `chunks` {name: new tokens}; return q, k, v and the step's common metadata."""
        slots, seq_lens, qsl = [], [], [0]
        for name, n in chunks.items():
            start = self.lens[name]
            while len(self.blocks[name]) * BLOCK < start + n:
                self.blocks[name].append(self.free.pop())
            slots += [self.blocks[name][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
            self.lens[name] = start + n
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
        width = max(len(self.blocks[name]) for name in chunks)
        tables = torch.full((len(chunks), width), -1, dtype=torch.long)
        for i, name in enumerate(chunks):
            tables[i, : len(self.blocks[name])] = torch.tensor(self.blocks[name])
        common = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=seq_lens,
                                   query_start_loc=qsl, block_size=BLOCK, req_ids=tuple(chunks))
        total = qsl[-1]
        q = torch.randn(total, HEADS * HEAD_SIZE, generator=self.gen)
        k = torch.randn(total, KV_HEADS * HEAD_SIZE, generator=self.gen)
        v = torch.randn(total, KV_HEADS * HEAD_SIZE, generator=self.gen)
        return q, k, v, common


def run_step(sim: Sim, chunks: dict[str, int]) -> bool:
    """One step through both backends; asserts equal outputs; returns whether the buffer was reused."""
    q, k, v, common = sim.step(chunks)
    before = sim.decode_context.buffer
    before_lens = sim.decode_context.lens
    expected = sim.plain(q, k, v, sim.sdpa_backend.build_metadata(common))
    keyed = sim.cpu_backend.build_metadata(common)
    assert isinstance(keyed, CPUAttentionMetadata)
    got = sim.keyed(q, k, v, keyed)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    reused = before is not None and sim.decode_context.buffer is before and before_lens == keyed.decode_prev_lens
    return reused


def test_buffer_path_equals_per_step_gather_through_a_serving_run(monkeypatch):
    monkeypatch.setattr(decode_context, "_GROWTH", 4)  # outgrow the buffer every few steps
    sim = Sim()
    for name in "abc":
        sim.add(name)
    run_step(sim, {"a": 5, "b": 9})  # whole prompts
    run_step(sim, {"a": 1, "b": 1, "c": 3})  # decodes and a prompt in one step
    reuses = [run_step(sim, {"a": 1, "b": 1, "c": 1}) for _ in range(30)]
    assert reuses[0] is False and sum(reuses) >= 20  # rebuilt when the batch changed or outgrew the buffer
    sim.remove("c")  # finished
    assert run_step(sim, {"a": 1, "b": 1}) is False
    sim.add("d")
    run_step(sim, {"a": 1, "b": 1, "d": 6})  # d prefilled in two chunks while a, b decode
    run_step(sim, {"a": 1, "b": 1, "d": 7})
    assert run_step(sim, {"a": 1, "b": 1, "d": 1}) is False
    assert run_step(sim, {"a": 1, "b": 1, "d": 1}) is True
    sim.new_key("b")  # b preempted and recomputed: same content, new key
    assert run_step(sim, {"a": 1, "b": 1, "d": 1}) is False
    for _ in range(10):
        run_step(sim, {"a": 1, "b": 1, "d": 1})
    # A budget too small for the batch: at the next rebuild the layer drops the buffer
    # and gathers per step.
    sim.decode_context.max_bytes = 1024
    sim.new_key("a")
    run_step(sim, {"a": 1, "b": 1, "d": 1})
    assert sim.decode_context.buffer is None
    run_step(sim, {"a": 1, "b": 1, "d": 1})


def test_runner_shares_the_budget_and_renews_keys_of_reused_or_preempted_requests(tiny_models):
    from engine.arg_utils import create_engine_config
    from worker.model_runner import ModelRunner

    config = create_engine_config(model=str(tiny_models["llama"]), device="cpu", dtype="float32", use_tqdm_on_load=False)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()

    def scheduled(req_id: str) -> ScheduledRequest:
        return ScheduledRequest(req_id, [5], 3, [0], True, SamplingParams(), 0)

    from worker.kv_cache import KVCacheConfig

    runner.initialize_kv_cache(KVCacheConfig.from_spec(runner.get_kv_cache_spec(), 8))
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    impls = [layer.impl for layer in layers]
    assert all(isinstance(impl, CPUAttentionImpl) for impl in impls)
    assert all(impl.decode_context.max_bytes == decode_context.TOTAL_BYTES // len(layers) for impl in impls)

    def seq_keys(output: SchedulerOutput) -> tuple[int, ...]:
        md = runner._prepare_inputs(output)[2]
        assert isinstance(md, CPUAttentionMetadata)
        return md.seq_keys

    first = seq_keys(SchedulerOutput([scheduled("x"), scheduled("y")], [], 2))
    again = seq_keys(SchedulerOutput([scheduled("x"), scheduled("y")], [], 2))
    assert first == again and len(set(first)) == 2
    # "x" finished (or was preempted) and an "x" is scheduled again: it must not match.
    after = seq_keys(SchedulerOutput([scheduled("x"), scheduled("y")], ["x"], 2))
    assert after[1] == first[1] and after[0] not in first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_mask_matches_query_dtype(dtype):
    md = CPUAttentionMetadata(slot_mapping=torch.tensor([0, 1]), block_tables=torch.tensor([[0], [1]]),
                              seq_lens=[3, 1], query_start_loc=[0, 1, 2], block_size=4, seq_keys=(0, 1))
    mask = md.decode_mask(dtype)
    assert mask.dtype == dtype and mask.shape == (1, 2, 1, 3)
    assert mask[0, 0, 0].tolist() == [0, 0, 0] and mask[0, 1, 0, 1:].isinf().all()
