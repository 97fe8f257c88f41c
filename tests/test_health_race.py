"""The health check is safe from any thread while the engine thread steps (issue 34).

`GET /health` runs `EngineCore.check_health(restart=False)` on the server's event loop,
so `MultiprocExecutor.check_health` runs on a thread other than the one that sends
calls. After a call failed on one rank while another still ran it, both threads may
settle it at once: every health check must still either return or raise
EngineDeadError (never an AssertionError, a TypeError, ...), must never block, and the
steps' outputs stay what they are without the probes.

Tested on a TP=2 engine with several threads checking health in a tight loop (with
a tiny GIL switch interval, so a thread is interrupted anywhere), and on a TP=2
`engine.serve` whose /health is probed while completions are in flight.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from config import SamplingParams
from engine.core import EngineCore
from executor.errors import EngineDeadError, RemoteWorkerError
from tests.runtime_helpers import DEATH_BOUND_S, engine_config, fail_on_rank_1_while_rank_0_waits
from tests.test_serve import MODEL_NAME, ServerProcess, _server_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 6], [7] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ROUNDS = 30
PROBE_THREADS = 6
# The longest one health check may take: it runs on the server's event loop.
CHECK_BOUND_S = 0.5


def fail_on_rank_1_while_rank_0_works(worker: Any, seconds: float, marker: str) -> str:
    """RPC body: rank 1 raises at once; rank 0 works on for `seconds` after rank 1 has
    failed (it waits for the `marker` file rank 1 writes first, so that on a loaded
    host rank 1's failure still reaches the engine before rank 0's reply), outside any
    collective, then returns. The call failed on one rank while the other still runs
    it, without being stuck: it settles once rank 0 is done."""
    if worker.rank == 1:
        Path(marker).touch()
        raise ValueError("boom on rank 1")
    give_up = time.monotonic() + 60
    while not Path(marker).exists() and time.monotonic() < give_up:
        time.sleep(0.005)
    time.sleep(seconds)
    return "done"


class HealthProbes:
    """`threads` threads calling `check` in a tight loop until stopped; records what
    each call raised (other than EngineDeadError) and the slowest call."""

    def __init__(self, check: Callable[[], None], threads: int = PROBE_THREADS) -> None:
        self.check = check
        self.calls = 0
        self.dead = 0  # calls that raised EngineDeadError
        self.unexpected: list[BaseException] = []
        self.slowest_s = 0.0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"health-probe-{i}", daemon=True)
                         for i in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                self.check()
            except EngineDeadError:
                self.dead += 1
            except BaseException as e:  # noqa: BLE001 - what the test is about
                self.unexpected.append(e)
            self.slowest_s = max(self.slowest_s, time.monotonic() - start)
            self.calls += 1

    def __enter__(self) -> HealthProbes:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in self._threads), "a health check never returned"


@contextmanager
def tiny_switch_interval() -> Iterator[None]:
    """Let the interpreter switch threads at almost every instruction, so a probe is
    interrupted anywhere in check_health, including between two reads of one field."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_health_checks_during_steps_and_failed_calls_return_or_raise_engine_dead(tiny_models, tmp_path):
    """Each round: a call fails on rank 1 while rank 0 still runs it (the executor must
    settle it before the next call), then a batch of steps; meanwhile probes check
    health without pause, from threads that never send a call."""
    with EngineCore(engine_config(tiny_models["llama"], tp=2)) as core:
        expected = token_ids(core.generate(PROMPTS, PARAMS))
        with tiny_switch_interval(), HealthProbes(lambda: core.check_health(restart=False)) as probes:
            for i in range(ROUNDS):
                with pytest.raises(RemoteWorkerError, match="boom on rank 1") as info:
                    core.collective_rpc(fail_on_rank_1_while_rank_0_works, args=(0.3, str(tmp_path / f"failed-{i}")),
                                        unique_reply_rank=0, timeout=60)
                assert info.value.rank == 1
                assert token_ids(core.generate(PROMPTS, PARAMS)) == expected
        assert probes.unexpected == [], f"{len(probes.unexpected)} health checks raised: {probes.unexpected[:3]!r}"
        assert probes.dead == 0  # the group never failed: no call was stuck
        assert probes.calls > ROUNDS * PROBE_THREADS
        assert probes.slowest_s < CHECK_BOUND_S, probes.slowest_s
        core.check_health()
        assert core.collective_rpc(lambda worker: worker.rank) == [0, 1]


def test_health_checks_see_an_out_of_step_group_die_and_raise_only_engine_dead(tiny_models):
    """A call fails on rank 1 while rank 0 waits in a collective rank 1 left: whichever
    thread settles it (a probe or the engine thread) fails the group, with the same
    verdict, and every health check after that raises EngineDeadError, at once."""
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    try:
        with tiny_switch_interval(), HealthProbes(core.model_executor.check_health) as probes:
            with pytest.raises(RemoteWorkerError, match="boom on rank 1"):
                core.collective_rpc(fail_on_rank_1_while_rank_0_waits, unique_reply_rank=0, timeout=120)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match=r"rank\(s\) \[0\] can never finish"):
                core.collective_rpc("check_health", timeout=120)
            assert time.monotonic() - start < DEATH_BOUND_S
            dead_before = probes.dead
            deadline = time.monotonic() + DEATH_BOUND_S
            while probes.dead < dead_before + 10 * PROBE_THREADS and time.monotonic() < deadline:
                time.sleep(0.01)
        assert probes.unexpected == [], f"{len(probes.unexpected)} health checks raised: {probes.unexpected[:3]!r}"
        assert probes.dead >= 10 * PROBE_THREADS
        assert probes.slowest_s < CHECK_BOUND_S, probes.slowest_s
        with pytest.raises(EngineDeadError, match=r"rank\(s\) \[0\] can never finish"):
            core.check_health(restart=False)
    finally:
        core.shutdown()


def test_served_health_is_200_while_completions_are_in_flight(serve_model: Path, tmp_path: Path):
    """A TP=2 server answers every GET /health with 200 while completions run."""
    server = ServerProcess(_server_args(serve_model), tmp_path / "server.log").start()
    try:
        statuses: list[int] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as http:
                while not stop.is_set():
                    try:
                        statuses.append(http.get("/health").status_code)
                    except BaseException as e:  # noqa: BLE001 - reported below
                        errors.append(e)

        def complete(i: int, results: dict[int, Any]) -> None:
            body = {"model": MODEL_NAME, "prompt": f"request {i} says", "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            results[i] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

        probes = [threading.Thread(target=probe, daemon=True) for _ in range(2)]
        for thread in probes:
            thread.start()
        results: dict[int, Any] = {}
        for _ in range(3):
            clients = [threading.Thread(target=complete, args=(i, results)) for i in range(6)]
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join(timeout=120)
        stop.set()
        for thread in probes:
            thread.join(timeout=30)
        assert errors == [], errors[:3]
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        assert sorted(results) == list(range(6))
        for response in results.values():
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 24
    finally:
        server.stop()
