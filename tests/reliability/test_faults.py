"""The fault matrix at TP=2 on the mp backend (issue 12): each fault is injected for real
(a rank made to hang at a precise point, then SIGKILLed; a forward hook that raises or
hangs; a collective a peer leaves), and each is followed by a check that no process,
shared-memory segment, socket or file of ours remains.

What each asserts: the error names the rank, it comes within a liveness bound, and
every later call raises at once or works (none hangs). Figures are printed (-s) for
the "Failure behaviour" table of docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from typing import Any, Callable

import pytest

from config import SamplingParams
from engine.core import EngineCore
from executor.errors import EngineDeadError, RemoteWorkerError, WorkerStartupError
from tests.reliability.helpers import (
    arm_forward_fault,
    assert_nothing_left,
    engine_dirs,
    queue_sockets,
    wait_for_marker,
)
from tests.runtime_helpers import (
    DEATH_BOUND_S,
    engine_config,
    fail_on_rank_1_while_rank_0_waits,
    live_children,
    shm_segments,
    worker_pids,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
# After a failure, a later call must raise (or work) within this: "at once" plus the
# settle grace (1 s) and a loaded box's slack; never a hang.
LATER_CALL_S = 5.0


def _figure(name: str, seconds: float) -> None:
    print(f"\nFIGURE {name}: {seconds:.2f}s", flush=True)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run fn in a thread; its result or exception, and when it came, land in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _later_calls_fail_fast(core: EngineCore, rank: int) -> None:
    """Dead for good: each later call raises EngineDeadError naming `rank`, at once."""
    for call in (lambda: core.collective_rpc("check_health", timeout=60), core.check_health,
                 lambda: core.generate(PROMPTS, GREEDY)):
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"rank\\(?s?\\)? ?\\[?{rank}"):
            call()
        assert time.monotonic() - start < LATER_CALL_S


# ---------------------------------------------------------------- SIGKILL a worker


@pytest.mark.parametrize("phase", ["load", "profile"])
def test_sigkill_worker_during_startup_phase(tiny_models, private_tmpdir, tmp_path, monkeypatch, phase):
    """Rank 1 is held at the start of `phase` (TP_FAULT_INJECT), then SIGKILLed: start-up
    fails naming rank 1 and its exit code, and leaves nothing."""
    marker = tmp_path / f"marker_{phase}"
    monkeypatch.setenv("TP_FAULT_INJECT", f"1:{phase}:hang")
    monkeypatch.setenv("TP_FAULT_MARKER", str(marker))
    shm_before, children_before, dirs_before = shm_segments(), live_children(), engine_dirs()
    # The profile run happens only when the budget is a share of memory.
    overrides = dict(kv_cache_memory_bytes=None, gpu_memory_utilization=0.01) if phase == "profile" else {}
    thread, out = _in_thread(lambda: EngineCore(engine_config(tiny_models["llama"], tp=2, **overrides)))
    pid = wait_for_marker(marker)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "start-up did not fail after a rank was SIGKILLed"
    error = out.get("error")
    expected = WorkerStartupError if phase == "load" else EngineDeadError
    assert isinstance(error, expected), repr(error)
    msg = str(error)
    assert "rank 1" in msg and str(pid) in msg and str(-signal.SIGKILL) in msg, msg
    assert out["at"] - killed_at < DEATH_BOUND_S
    _figure(f"sigkill during {phase} -> {type(error).__name__}", out["at"] - killed_at)
    children = live_children() - children_before
    assert_nothing_left(children, None, shm_before, tmpdir=private_tmpdir)
    assert engine_dirs() <= dirs_before, f"private directories left: {engine_dirs() - dirs_before}"


@pytest.mark.parametrize("when", ["step", "idle"])
def test_sigkill_worker_serving(tiny_models, private_tmpdir, tmp_path, when):
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    try:
        assert core.generate(PROMPTS, GREEDY)  # it works before the fault
        if when == "step":
            marker = tmp_path / "in_forward"
            core.collective_rpc(arm_forward_fault, args=(1, "hang", 1, str(marker)))
            thread, out = _in_thread(lambda: core.generate(PROMPTS, GREEDY))
            assert wait_for_marker(marker) == pids[1]
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
            thread.join(timeout=60)
            assert not thread.is_alive()
            error, noticed = out.get("error"), out["at"]
        else:
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
            error = None
            while time.monotonic() - killed_at < 2 * DEATH_BOUND_S:
                try:
                    core.check_health()
                except EngineDeadError as e:
                    error = e
                    break
                time.sleep(0.01)
            noticed = time.monotonic()
        assert isinstance(error, EngineDeadError), repr(error)
        assert "rank 1" in str(error) and str(pids[1]) in str(error), str(error)
        assert noticed - killed_at < DEATH_BOUND_S
        _figure(f"sigkill while {when} -> EngineDeadError", noticed - killed_at)
        _later_calls_fail_fast(core, 1)
    finally:
        core.shutdown()
    assert_nothing_left(pids, ipc_dir, shm_before, tmpdir=private_tmpdir)


# ---------------------------------------------------------------- a worker raises


def test_raise_in_forward_on_step_n(tiny_models, private_tmpdir):
    """Rank 1 raises in its 3rd forward; rank 0 is then left in an all-reduce of that
    step. The step raises RemoteWorkerError naming rank 1 at once; the next call finds
    the ranks out of step and raises EngineDeadError instead of running on a group whose
    collectives no longer pair up."""
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    try:
        core.collective_rpc(arm_forward_fault, args=(1, "raise", 3))
        start = time.monotonic()
        with pytest.raises(RemoteWorkerError, match="injected fault in forward #3 on rank 1") as info:
            core.generate(PROMPTS, GREEDY)
        assert info.value.rank == 1
        assert time.monotonic() - start < DEATH_BOUND_S
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) \[0\] can never finish 'execute_model'") as dead:
            core.collective_rpc("check_health", timeout=60)
        _figure("raise in forward: next call -> EngineDeadError", time.monotonic() - start)
        assert time.monotonic() - start < LATER_CALL_S
        assert "rank 1 failed in it" in str(dead.value)
        _later_calls_fail_fast(core, 0)
    finally:
        core.shutdown()
    assert_nothing_left(pids, ipc_dir, shm_before, tmpdir=private_tmpdir)


@pytest.mark.parametrize("unique_reply_rank", [0, None])
def test_raise_inside_collective_while_peer_waits(tiny_models, private_tmpdir, unique_reply_rank):
    """The issue's hang: rank 1 raises while rank 0 waits in a barrier. The call raises
    RemoteWorkerError naming rank 1 at once; the next collective_rpc("check_health"),
    which used to never return, raises EngineDeadError (rank 0 is stuck for good)."""
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    try:
        start = time.monotonic()
        with pytest.raises(RemoteWorkerError, match="boom on rank 1") as info:
            core.collective_rpc(fail_on_rank_1_while_rank_0_waits, unique_reply_rank=unique_reply_rank, timeout=120)
        assert info.value.rank == 1
        assert time.monotonic() - start < DEATH_BOUND_S
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) \[0\] can never finish"):
            core.collective_rpc("check_health", timeout=60)
        _figure("raise in a collective: next call -> EngineDeadError", time.monotonic() - start)
        assert time.monotonic() - start < LATER_CALL_S
        _later_calls_fail_fast(core, 0)
    finally:
        core.shutdown()
    assert_nothing_left(pids, ipc_dir, shm_before, tmpdir=private_tmpdir)


def test_raise_on_one_rank_without_collective_keeps_the_engine(tiny_models):
    """A callable that fails on rank 1 while rank 0 finishes normally leaves the group in
    step: the failure is reported, and the next calls work."""
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    try:
        def fail_on_1(worker):
            if worker.rank == 1:
                raise ValueError("only rank 1")
            time.sleep(0.3)
            return worker.rank

        with pytest.raises(RemoteWorkerError, match="only rank 1"):
            core.collective_rpc(fail_on_1)
        assert core.collective_rpc("check_health", timeout=60) == [True, True]
        assert core.generate(PROMPTS, GREEDY)
    finally:
        core.shutdown()


# ---------------------------------------------------------------- a worker hangs


def test_hang_in_forward_is_named_by_the_liveness_check(tiny_models, private_tmpdir, tmp_path):
    """Rank 1 sleeps for good inside a forward while rank 0 waits in the all-reduce: after
    worker_liveness_timeout_s of silence the step raises EngineDeadError naming rank 1
    (not rank 0, which waits in a collective), not after the 300 s step timeout."""
    limit = 2.0
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2, worker_liveness_timeout_s=limit))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    try:
        marker = tmp_path / "hung"
        core.collective_rpc(arm_forward_fault, args=(1, "hang", 2, str(marker)))
        thread, out = _in_thread(lambda: core.generate(PROMPTS, GREEDY))
        wait_for_marker(marker)
        hung_at = time.monotonic()
        thread.join(timeout=limit + 60)
        assert not thread.is_alive(), "the hung rank was never detected"
        error = out.get("error")
        assert isinstance(error, EngineDeadError), repr(error)
        msg = str(error)
        assert f"worker rank 1 (pid {pids[1]}) is hung" in msg and "rank 0" not in msg, msg
        assert f"worker_liveness_timeout_s={limit:g}" in msg, msg
        took = out["at"] - hung_at
        assert limit <= took + 0.2 < limit + DEATH_BOUND_S, took
        _figure(f"hang in forward (timeout {limit:g}s) -> EngineDeadError", took)
        _later_calls_fail_fast(core, 1)
    finally:
        core.shutdown()
    assert_nothing_left(pids, ipc_dir, shm_before, tmpdir=private_tmpdir)


def test_slow_step_is_not_taken_for_a_hang(tiny_models):
    """A rank that computes (uses CPU) for longer than the liveness timeout is slow, not
    hung: the step completes."""
    core = EngineCore(engine_config(tiny_models["llama"], tp=2, worker_liveness_timeout_s=1.0))
    try:
        core.collective_rpc(arm_forward_fault, args=(1, "busy", 1, None, 3.0))
        assert core.generate(PROMPTS, GREEDY)
        assert core.collective_rpc("check_health") == [True, True]
    finally:
        core.shutdown()


def test_stopped_worker_is_named_by_its_missing_heartbeat(tiny_models, private_tmpdir):
    """SIGSTOP freezes a rank while idle: its heartbeat stops and the engine names it."""
    limit = 1.5
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2, worker_liveness_timeout_s=limit))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    try:
        os.kill(pids[0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        error = None
        while time.monotonic() - stopped_at < limit + 2 * DEATH_BOUND_S:
            try:
                core.check_health()
            except EngineDeadError as e:
                error = e
                break
            time.sleep(0.01)
        assert error is not None and "worker rank 0" in str(error) and "heartbeat" in str(error), error
        _figure(f"SIGSTOP (timeout {limit:g}s) -> EngineDeadError", time.monotonic() - stopped_at)
        _later_calls_fail_fast(core, 0)
    finally:
        core.shutdown()  # SIGKILL works on a stopped process
    assert_nothing_left(pids, ipc_dir, shm_before, tmpdir=private_tmpdir)


def test_liveness_defaults(tiny_models):
    from engine.arg_utils import create_engine_config

    config = create_engine_config(model=str(tiny_models["llama"]), device="cpu")
    assert 0 < config.worker_liveness_timeout_s <= 10.0


# ---------------------------------------------------------------- a clean run leaves nothing


def test_clean_run_sockets_are_files_in_a_private_dir(tiny_models, private_tmpdir):
    """While running, every queue socket is a file in the engine's 0700 directory (no
    abstract name, which no permission guards) and no segment is linked; after shutdown
    neither the directory nor any socket is left."""
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    try:
        assert core.generate(PROMPTS, GREEDY)
        sockets = queue_sockets()
        assert len(sockets) >= 3, sockets  # 3 queues' overflow sockets, listening
        assert all(name.startswith(ipc_dir + "/") for name in sockets), sockets
        # One wake-up FIFO per reader: the broadcast queue's two ranks, the engine on each reply queue.
        fifos = [os.path.join(ipc_dir, n) for n in os.listdir(ipc_dir) if ".wake" in n]
        assert len(fifos) == 4, os.listdir(ipc_dir)
        assert all(stat.S_ISFIFO(os.stat(f).st_mode) and os.stat(f).st_mode & 0o077 == 0 for f in fifos), fifos
        assert os.stat(ipc_dir).st_mode & 0o077 == 0, oct(os.stat(ipc_dir).st_mode)
        assert shm_segments() == shm_before  # every segment unlinked once mapped
    finally:
        core.shutdown()
    assert_nothing_left(pids, ipc_dir, shm_before, tmpdir=private_tmpdir)


# ---------------------------------------------------------------- Worker.check_health checks


def _health_with_kv_freed(worker):
    worker.model_runner.kv_cache_memory.release()  # the pool's state still says awake
    return worker.check_health()


def _health_with_a_dead_peer(worker):
    import subprocess
    import sys

    from worker.peer_watch import PeerWatch

    if worker.rank == 0:  # rank 0 watches a real process, now gone, as its peer rank 1
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        watch = PeerWatch(gone.pid)
        gone.wait()
        worker._peers = {1: watch}
    return worker.check_health()


def test_worker_check_health_checks_something(tiny_models):
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    try:
        assert core.collective_rpc("check_health", kwargs={"probe_collective": True}) == [True, True]
        with pytest.raises(RemoteWorkerError, match="TP peer\\(s\\) gone: rank 1 \\(pid \\d+\\)"):
            core.collective_rpc(_health_with_a_dead_peer, unique_reply_rank=0)
        with pytest.raises(RemoteWorkerError, match="the KV cache is not allocated"):
            core.collective_rpc(_health_with_kv_freed)
    finally:
        core.shutdown()
