"""End-to-end EngineCore tests with real worker processes on CPU/gloo (issue 3).

Start-up at TP 1/2/4 with identical KV caches on every rank, collective_rpc (by name,
callables, timeout, unique_reply_rank, > 64 MiB messages, remote exceptions), greedy
TP=2 == TP=1, context manager / garbage collection shutdown, and the spawn start method.
Crash, leak and start-up failure tests live in test_engine_failures.py.
"""

from __future__ import annotations

import gc
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from config import SamplingParams
from engine.core import EngineCore
from executor.errors import EngineDeadError, RemoteWorkerError
from executor.multiproc_executor import MultiprocExecutor
from executor.uniproc_executor import UniProcExecutor
from tests.runtime_helpers import (
    assert_nothing_left,
    engine_config,
    kv_layout,
    live_children,
    pid_alive,
    shm_segments,
    worker_pids,
)

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
BIG = 65 * MIB  # above 64 MiB


@pytest.fixture(scope="module")
def engine_tp2(tiny_models: dict[str, Path]) -> Iterator[EngineCore]:
    """One TP=2 engine shared by the RPC tests; each of them leaves it working."""
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    try:
        yield core
    finally:
        core.shutdown()


# ---------------------------------------------------------------- start-up and KV cache


@pytest.mark.parametrize(
    "model_name,tp,kv_heads_per_rank",
    [
        ("llama", 1, 2),
        ("llama", 2, 1),
        ("llama", 4, 1),  # 2 kv heads over 4 ranks: each replicated on two ranks
        ("llama_h8_kv2", 4, 1),
    ],
)
@pytest.mark.slow
def test_engine_starts_with_equal_kv_cache_on_every_rank(tiny_models, model_name, tp, kv_heads_per_rank):
    shm_before = shm_segments()
    config = engine_config(tiny_models[model_name], tp=tp)
    mc = config.model_config
    with EngineCore(config) as core:
        expected_executor = UniProcExecutor if tp == 1 else MultiprocExecutor
        assert isinstance(core.model_executor, expected_executor)
        kv = core.kv_cache_config
        assert kv.num_blocks > 0
        assert kv.num_kv_heads_per_rank == kv_heads_per_rank
        # Every rank sized its cache from the same budget: budget // block_bytes blocks.
        assert kv.num_blocks == config.cache_config.kv_cache_memory_bytes // kv.block_bytes

        layouts = core.collective_rpc(kv_layout)
        assert [lay["rank"] for lay in layouts] == list(range(tp))
        head_dim = getattr(mc.hf_config, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        expected_shape = (kv.num_blocks, 2, config.cache_config.block_size, kv_heads_per_rank, head_dim)
        for lay in layouts:
            assert lay["num_blocks"] == kv.num_blocks
            assert lay["num_kv_heads_per_rank"] == kv_heads_per_rank
            assert lay["shapes"] == [expected_shape] * mc.num_layers
            assert lay["dtypes"] == ["torch.float32"] * mc.num_layers

        if tp > 1:
            pids = worker_pids(core)
            # Each rank really is its own process, the one the executor started.
            assert [lay["pid"] for lay in layouts] == pids
            assert len(set(pids)) == tp and os.getpid() not in pids
            ipc_dir = core.model_executor._ipc_dir
        # Startup phases are timed per rank.
        assert len(core.startup_timings["per_rank"]) == tp
        for phase in ("spawn", "distributed_init", "load", "profile", "kv_alloc", "total"):
            assert core.startup_timings[phase] >= 0.0
    if tp > 1:
        assert_nothing_left(pids, ipc_dir, shm_before)


def test_multiproc_executor_at_tp1(tiny_models):
    """distributed_executor_backend="mp" runs even a single rank in a worker process."""
    shm_before = shm_segments()
    with EngineCore(engine_config(tiny_models["llama"], tp=1, distributed_executor_backend="mp")) as core:
        assert isinstance(core.model_executor, MultiprocExecutor)
        (lay,) = core.collective_rpc(kv_layout)
        assert lay["pid"] == worker_pids(core)[0] != os.getpid()
        assert lay["num_blocks"] == core.kv_cache_config.num_blocks
        pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    assert_nothing_left(pids, ipc_dir, shm_before)


# ---------------------------------------------------------------- collective_rpc


def test_rpc_by_name(engine_tp2):
    assert engine_tp2.collective_rpc("check_health") == [True, True]
    timings = engine_tp2.collective_rpc("get_timings")
    assert len(timings) == 2
    for t in timings:
        assert {"distributed_init", "load", "profile", "kv_alloc"} <= set(t)
    # A method name that does not exist is a worker-side AttributeError.
    with pytest.raises(RemoteWorkerError, match="no_such_method"):
        engine_tp2.collective_rpc("no_such_method")
    assert engine_tp2.collective_rpc("check_health") == [True, True]


def test_rpc_callable_closure_args_kwargs(engine_tp2):
    secret = {"value": 1234, "tag": "captured"}

    def closure(worker, offset, scale=1):
        return (worker.rank, worker.world_size, secret["value"] * scale + offset, secret["tag"], os.getpid())

    results = engine_tp2.collective_rpc(closure, args=(5,), kwargs={"scale": 2})
    assert [r[:4] for r in results] == [(0, 2, 2473, "captured"), (1, 2, 2473, "captured")]
    assert [r[4] for r in results] == worker_pids(engine_tp2)
    assert engine_tp2.collective_rpc(lambda w: w.rank * 10) == [0, 10]


def test_rpc_unique_reply_rank(engine_tp2):
    assert engine_tp2.collective_rpc(lambda w: ("rank", w.rank), unique_reply_rank=1) == ("rank", 1)
    assert engine_tp2.collective_rpc(lambda w: ("rank", w.rank), unique_reply_rank=0) == ("rank", 0)
    assert engine_tp2.collective_rpc("check_health", unique_reply_rank=1) is True
    with pytest.raises(ValueError, match="unique_reply_rank"):
        engine_tp2.collective_rpc("check_health", unique_reply_rank=2)
    # The silent rank's reply does not linger: the next full call lines up.
    assert engine_tp2.collective_rpc(lambda w: w.rank) == [0, 1]


def test_rpc_method_that_is_neither_a_name_nor_a_callable_is_refused_in_the_caller(engine_tp2, tiny_models):
    with pytest.raises(TypeError, match="Worker method name or a callable.*got 'bytes'"):
        engine_tp2.collective_rpc(b"pickled elsewhere")
    assert engine_tp2.collective_rpc(lambda w: w.rank) == [0, 1]
    with EngineCore(engine_config(tiny_models["llama"], tp=1)) as uni:  # the in-process executor
        with pytest.raises(TypeError, match="got 'int'"):
            uni.collective_rpc(42)
        assert uni.collective_rpc(lambda w: w.rank) == [0]


@pytest.mark.slow
def test_rpc_timeout_then_engine_still_works(engine_tp2):
    def slow(worker, seconds):
        time.sleep(seconds)
        return ("late", worker.rank)

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        engine_tp2.collective_rpc(slow, args=(3.0,), timeout=0.5)
    assert time.monotonic() - start < 3.0  # it did not wait for the slow call to finish
    # The late replies of the timed-out call are discarded, not returned to the next call.
    assert engine_tp2.collective_rpc(lambda w: ("fresh", w.rank)) == [("fresh", 0), ("fresh", 1)]
    assert engine_tp2.collective_rpc(lambda w: ("again", w.rank), unique_reply_rank=1) == ("again", 1)
    # A timeout that is long enough changes nothing.
    assert engine_tp2.collective_rpc("check_health", timeout=60) == [True, True]
    engine_tp2.check_health()


@pytest.mark.slow
def test_rpc_timeout_with_unique_reply_rank(engine_tp2):
    def slow_on_rank1(worker):
        if worker.rank == 1:
            time.sleep(2.0)
        return ("late", worker.rank)

    with pytest.raises(TimeoutError):
        engine_tp2.collective_rpc(slow_on_rank1, timeout=0.3, unique_reply_rank=1)
    assert engine_tp2.collective_rpc(lambda w: ("fresh", w.rank)) == [("fresh", 0), ("fresh", 1)]


@pytest.mark.slow
def test_rpc_large_messages(engine_tp2):
    payload = os.urandom(1024) * (BIG // 1024)
    assert len(payload) > 64 * MIB
    digest = hashlib.sha256(payload).hexdigest()

    def measure(worker, data):
        return len(data), hashlib.sha256(data).hexdigest()

    assert engine_tp2.collective_rpc(measure, args=(payload,)) == [(BIG, digest)] * 2

    def produce(worker, n):
        return bytes([worker.rank + 1]) * n

    results = engine_tp2.collective_rpc(produce, args=(BIG,))
    assert [len(r) for r in results] == [BIG, BIG]
    assert results[0] == b"\x01" * BIG and results[1] == b"\x02" * BIG
    del results

    # An arg echoed back whole (rank 1 only, to keep memory in check).
    echoed = engine_tp2.collective_rpc(lambda w, d: d, args=(payload,), unique_reply_rank=1)
    assert echoed == payload
    del echoed
    # Small messages still line up afterwards.
    assert engine_tp2.collective_rpc(lambda w: w.rank) == [0, 1]


def test_remote_exception_carries_traceback(engine_tp2):
    def explode_in_worker(worker, rank_to_fail):
        if worker.rank == rank_to_fail:
            raise ValueError(f"deliberate failure on rank {worker.rank}")
        return worker.rank

    with pytest.raises(RemoteWorkerError) as info:
        engine_tp2.collective_rpc(explode_in_worker, args=(1,))
    err = info.value
    assert err.rank == 1
    assert err.method == "explode_in_worker"
    assert "ValueError: deliberate failure on rank 1" in err.error
    assert "explode_in_worker" in err.remote_traceback
    assert "Traceback (most recent call last)" in err.remote_traceback
    assert "explode_in_worker" in str(err) and "rank 1" in str(err)

    # Every rank failing: the first rank in order is reported.
    with pytest.raises(RemoteWorkerError) as info:
        engine_tp2.collective_rpc(lambda w: 1 / 0)
    assert info.value.rank == 0 and "ZeroDivisionError" in str(info.value)

    # The workers stay up and the replies stay in step.
    assert engine_tp2.collective_rpc(lambda w: w.rank) == [0, 1]
    engine_tp2.check_health()
    out = engine_tp2.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_unpicklable_result_is_a_remote_error(engine_tp2):
    """A result that cannot be sent back is the caller's error, not the worker's death."""

    def make_lock(worker):
        return threading.Lock()

    with pytest.raises(RemoteWorkerError, match="pickle") as info:
        engine_tp2.collective_rpc(make_lock)
    assert info.value.rank == 0
    assert engine_tp2.collective_rpc(lambda w: w.rank) == [0, 1]
    engine_tp2.check_health()


def test_unpicklable_args_raise_in_the_caller(engine_tp2):
    with pytest.raises(TypeError, match="pickle"):
        engine_tp2.collective_rpc(lambda w, x: x, args=(threading.Lock(),))
    assert engine_tp2.collective_rpc(lambda w: w.rank) == [0, 1]


# ---------------------------------------------------------------- generation


def test_greedy_tp2_matches_tp1(tiny_models, engine_tp2):
    prompts = [[1, 17, 42, 99, 3], [250, 4, 8, 15, 16, 23, 42], list(range(10, 40))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with EngineCore(engine_config(tiny_models["llama"], tp=1)) as core1:
        ref = [o.token_ids for o in core1.generate(prompts, params)]
    got = [o.token_ids for o in engine_tp2.generate(prompts, params)]
    assert all(len(t) == 12 for t in ref)
    assert got == ref


def test_a_step_whose_request_never_got_its_sampling_params_is_an_error_naming_it(tiny_models, engine_tp2):
    """Params travel once, with a request's admission; a later step of a request the ranks
    never saw admitted is refused on every rank, before any collective, and the engine
    goes on serving."""
    from worker.outputs import ScheduledRequest, SchedulerOutput

    stray = ScheduledRequest("never-admitted", [5], 3, [0], True, None, 1)
    with pytest.raises(RemoteWorkerError, match="never-admitted"):
        engine_tp2.collective_rpc("execute_model", args=(SchedulerOutput([stray], [], 1),))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(engine_tp2.generate([[1, 2, 3]], params)[0].token_ids) == 4


# ---------------------------------------------------------------- lifetime


@pytest.mark.slow
def test_context_manager_shuts_down(tiny_models):
    shm_before = shm_segments()
    with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
        pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
        assert all(pid_alive(p) for p in pids)
        assert core.collective_rpc("check_health") == [True, True]
    assert_nothing_left(pids, ipc_dir, shm_before)
    # Shutdown is idempotent, and a dead engine says so.
    core.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        core.collective_rpc("check_health")


@pytest.mark.slow
def test_context_manager_shuts_down_on_exception(tiny_models):
    shm_before = shm_segments()
    with pytest.raises(KeyError, match="inside the block"):
        with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
            pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
            raise KeyError("inside the block")
    assert_nothing_left(pids, ipc_dir, shm_before)


@pytest.mark.slow
def test_garbage_collection_shuts_down(tiny_models):
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    assert core.collective_rpc("check_health") == [True, True]
    del core
    gc.collect()
    assert_nothing_left(pids, ipc_dir, shm_before)


@pytest.mark.slow
def test_spawn_start_method(tiny_models, monkeypatch):
    monkeypatch.setenv("TP_WORKER_MULTIPROC_METHOD", "spawn")
    shm_before = shm_segments()
    with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
        layouts = core.collective_rpc(kv_layout)
        pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
        assert [lay["pid"] for lay in layouts] == pids
        assert {lay["num_blocks"] for lay in layouts} == {core.kv_cache_config.num_blocks}
        out = core.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    assert_nothing_left(pids, ipc_dir, shm_before)


def test_bad_multiproc_method_is_rejected(tiny_models, monkeypatch):
    monkeypatch.setenv("TP_WORKER_MULTIPROC_METHOD", "fork")
    shm_before, children_before = shm_segments(), live_children()
    with pytest.raises(ValueError, match="TP_WORKER_MULTIPROC_METHOD"):
        EngineCore(engine_config(tiny_models["llama"], tp=2))
    assert shm_segments() == shm_before
    assert live_children() <= children_before


@pytest.mark.slow
def test_generate_refusing_a_prompt_leaves_no_request_behind(engine_tp2):
    vocab = engine_tp2.config.model_config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine_tp2.generate([[1, 2, 3], [vocab + 5]], SamplingParams(max_tokens=4, temperature=0))
    assert not engine_tp2.has_unfinished_requests()
    out = engine_tp2.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
