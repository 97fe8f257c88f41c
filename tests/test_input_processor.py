"""A request is validated once (engine/processor.py), and the worker restarter swaps the
executor through EngineCore's public `replace_executor` (issue 34).

The server validates on the request's own thread, so a bad request is a 400 that never
reaches the engine loop, and hands the engine a processed `EngineCoreRequest` that
`EngineCore.add_request` queues without checking it again; a library caller's plain
prompt is still validated by `EngineCore.add_request`. Tested on a real TP=1 engine
behind the real FastAPI app (in process, through httpx's ASGI transport).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from config import SamplingParams
from engine.core import EngineCore
from engine.processor import EngineCoreRequest
from tests.runtime_helpers import engine_config, pid_alive, wait_pids_gone, worker_pids

MODEL = "tiny-processor"


@pytest.fixture(scope="module")
def core(serve_model: Path) -> Iterator[EngineCore]:
    core = EngineCore(engine_config(serve_model, tp=1, max_num_seqs=4))
    yield core
    core.shutdown()


class Calls:
    """Wraps methods of one object; records (name, thread name) of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._restore: list[Callable[[], None]] = []

    def spy(self, obj: Any, name: str) -> None:
        original = getattr(obj, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.current_thread().name))
            return original(*args, **kwargs)

        setattr(obj, name, recorded)
        self._restore.append(lambda: delattr(obj, name))

    def count(self) -> Counter[str]:
        return Counter(name for name, _ in self.calls)

    def restore(self) -> None:
        for undo in self._restore:
            undo()


def serve(core: EngineCore, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """POST each body to /v1/completions of the real app over `core`, in turn."""
    from engine.async_engine import AsyncEngine
    from engine.entrypoints.openai.app import build_app

    engine = AsyncEngine(core, health_check_interval_s=0.1, log_stats=False)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(engine, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.post("/v1/completions", json={"model": MODEL, **body}, timeout=60)
                    for body in bodies]

    try:
        return asyncio.run(run())
    finally:
        engine.engine_loop.stop(timeout=30)  # the core stays up for the other tests


def test_a_served_request_is_validated_once_on_its_own_thread(core: EngineCore) -> None:
    calls = Calls()
    for name in ("process_inputs", "check_num_samples", "truncate_prompt"):
        calls.spy(core.processor, name)
    calls.spy(core, "add_request")
    try:
        [ok] = serve(core, [{"prompt": [1, 5, 9, 13, 17, 21], "max_tokens": 3, "truncate_prompt_tokens": 4,
                             "ignore_eos": True}])
    finally:
        calls.restore()
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == 4  # truncated once, by the processor
    # One validation, on the caller's (the event loop's) thread; the engine loop only queues it.
    assert calls.count() == Counter(process_inputs=1, check_num_samples=1, truncate_prompt=1, add_request=1)
    main = threading.main_thread().name
    assert [thread for name, thread in calls.calls if name != "add_request"] == [main] * 3
    assert [thread for name, thread in calls.calls if name == "add_request"] == ["engine-loop"]


@pytest.mark.parametrize("body, param, needle", [
    ({"n": 5}, "n", "n must be at most max_num_seqs=4"),
    ({"n": 1, "best_of": 5}, "best_of", "best_of must be at most max_num_seqs=4"),
    ({"prompt": [1, 2, 10**6]}, "prompt", "outside the vocabulary"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "outside the vocabulary"),
])
def test_a_bad_served_request_is_a_400_that_never_reaches_the_engine(core: EngineCore, body: dict[str, Any],
                                                                   param: str, needle: str) -> None:
    calls = Calls()
    calls.spy(core, "add_request")
    try:
        [refused] = serve(core, [{"prompt": [1, 2, 3], "max_tokens": 2, **body}])
    finally:
        calls.restore()
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert calls.calls == []  # refused before it was queued
    assert not core.has_unfinished_requests()


def test_the_library_path_validates_and_a_processed_request_is_not_validated_again(core: EngineCore) -> None:
    vocab = core.config.model_config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request([1, vocab])
    with pytest.raises(ValueError, match="stop_token_ids"):
        core.add_request([1, 2], SamplingParams(stop_token_ids=[vocab]))
    with pytest.raises(ValueError, match="n must be at most max_num_seqs=4"):
        core.add_request([1, 2], SamplingParams(n=5))
    assert not core.has_unfinished_requests()

    request = core.processor.process_inputs("processed", [7, 1, 2, 3], SamplingParams(
        max_tokens=2, truncate_prompt_tokens=3, truncation_side="right"))
    assert isinstance(request, EngineCoreRequest) and request.prompt_token_ids == [7, 1, 2]
    assert set(core.processor.eos_token_ids) <= set(request.sampling_params.all_stop_token_ids)
    calls = Calls()
    calls.spy(core.processor, "process_inputs")
    try:
        assert core.add_request(request) == "processed"
    finally:
        calls.restore()
    assert calls.calls == []
    assert core.scheduler.requests["processed"].prompt_token_ids == [7, 1, 2]
    while core.has_unfinished_requests():
        core.step()


@pytest.mark.slow
def test_replace_executor_swaps_the_worker_group_and_shutdown_follows(serve_model: Path) -> None:
    core = EngineCore(engine_config(serve_model, tp=1, distributed_executor_backend="mp"))
    try:
        old_executor, old_pids = core.model_executor, worker_pids(core)
        new_executor = core.replace_executor()
        assert new_executor is core.model_executor and new_executor is not old_executor
        assert wait_pids_gone(old_pids) == []  # the old group was shut down first
        new_pids = worker_pids(core)
        assert new_pids and not set(new_pids) & set(old_pids) and all(pid_alive(p) for p in new_pids)
        assert not core.is_shut_down
    finally:
        core.shutdown()
    assert core.is_shut_down
    assert wait_pids_gone(new_pids) == []
