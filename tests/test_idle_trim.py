"""An idle engine hands every rank's freed C heap back to the system
(`EngineCore.trim_host_memory`): glibc keeps what a batch's activations freed below its
dynamic mmap threshold, which the first large free raises, so a prefill's temporaries
stay resident for as long as the process lives otherwise. Measured on real ranks (worker
processes at TP 1 and 2, each a fresh engine's, and the engine's own process): the
anonymous memory a further `malloc_trim(0)` would hand back, on one engine without the
trim (the retention is there to see), on another after it (nothing left); called
directly after `generate`, and by the AsyncEngine's loop once it has been idle a
health-check interval (not before: a request that follows at once finds its pages still
there)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from config import SamplingParams
from engine.core import EngineCore
from engine.tiny_model import make_tiny_model
from models.layers.file_pages import trim_heap

pytestmark = pytest.mark.slow

RETAINED_KIB = 4096  # what the first batch leaves in a fresh rank's heap without the trim, at least
LEFT_KIB = 1024  # what may be left after it
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, detokenize=False)
# 8 prompts of 256 tokens: [2048, 2048] float32 MLP activations, 16 MiB each
PROMPTS = [[(i * 37 + j * 11) % 2000 + 3 for j in range(256)] for i in range(8)]


def returnable_kib(worker: object = None) -> int:
    """KiB of anonymous memory a malloc_trim(0) hands back in this process now (run on
    each rank through collective_rpc)."""

    def anon() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))

    before = anon()
    trim_heap()
    return before - anon()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("idle_trim") / "llama", "llama", hidden_size=256,
                           intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=2048, max_position_embeddings=1024, init_std=0.1, with_tokenizer=False, seed=3)


def make_core(model: Path, tp: int, backend: str = "mp") -> EngineCore:
    """Ranks in worker processes of their own by default: a fresh process's heap holds
    what the batch left and nothing else (pytest's own, after hundreds of tests, may have
    served the batch from free chunks it had already)."""
    return EngineCore(model=str(model), device="cpu", tensor_parallel_size=tp, distributed_executor_backend=backend,
                      kv_cache_memory_bytes=64 << 20, max_num_seqs=8, enable_prefix_caching=False)


@pytest.mark.parametrize("tp, backend", [(1, "mp"), (2, "mp"), (1, "uni")])
def test_every_ranks_freed_heap_is_handed_back(model: Path, tp: int, backend: str) -> None:
    if backend == "mp":  # the uni rank is this pytest process: no fresh heap to see the retention in
        with make_core(model, tp, backend) as core:
            core.generate(PROMPTS, PARAMS)
            retained = core.collective_rpc(returnable_kib)  # generate itself leaves the heap as it is
            assert len(retained) == tp and all(kib >= RETAINED_KIB for kib in retained), retained

    with make_core(model, tp, backend) as core:
        core.generate(PROMPTS, PARAMS)
        core.trim_host_memory()
        left = core.collective_rpc(returnable_kib)
        assert len(left) == tp and all(kib <= LEFT_KIB for kib in left), left

        calls = []
        rpc = core.collective_rpc
        core.collective_rpc = lambda *a, **k: calls.append(a) or rpc(*a, **k)  # type: ignore[method-assign]
        core.trim_host_memory()  # no step since the last: nothing to ask the ranks
        assert calls == []


def _served(model: Path, interval_s: float, trimming: bool) -> int:
    """KiB a further trim would hand back on the rank of a fresh TP=1 engine served through
    the AsyncEngine (every prompt at once), measured on its loop after 0.5 s with nothing
    to do; `trimming=False` switches the trim off."""
    from engine.async_engine import AsyncEngine

    with make_core(model, 1) as core:
        if not trimming:
            core.trim_host_memory = lambda: None  # type: ignore[method-assign]
        engine = AsyncEngine(core, health_check_interval_s=interval_s, log_stats=False)

        async def run() -> list[int]:
            async def last(prompt):  # noqa: ANN001, ANN202
                async for output in engine.generate(prompt, PARAMS):
                    final = output
                return final

            outputs = await asyncio.gather(*(last(p) for p in PROMPTS))
            assert all(o.finished and len(o.outputs[0].token_ids) == 2 for o in outputs)
            await asyncio.sleep(0.5)
            return await engine._on_loop(lambda c: c.collective_rpc(returnable_kib))

        try:
            return asyncio.run(run())[0]
        finally:
            engine.engine_loop.stop(timeout=30)


def test_the_engine_loop_hands_it_back_once_idle_an_interval(model: Path) -> None:
    assert _served(model, 0.1, trimming=False) >= RETAINED_KIB  # five intervals idle, no trim: still there
    assert _served(model, 0.1, trimming=True) <= LEFT_KIB


def test_requests_that_follow_at_once_find_the_heap_as_it_was(model: Path) -> None:
    """Within a health-check interval of the last request the loop has trimmed nothing:
    requests that follow at once do not pay for faulting their pages in again."""
    assert _served(model, 60, trimming=True) >= RETAINED_KIB
