"""End-to-end EngineCore failure and cleanup tests with real worker processes (issue 3).

A SIGKILLed worker becomes EngineDeadError naming the rank within seconds; a SIGKILLed
engine takes its workers with it and leaves nothing in its temp directory; shutdown
(also after 20 back-to-back start/stops) leaves no process, /dev/shm segment, socket,
file, fd or thread behind; a corrupt shard and a too-small KV budget fail start-up
cleanly with a clear error. The wider fault matrix is in tests/reliability/.
"""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from engine.core import EngineCore
from executor.errors import EngineDeadError, WorkerStartupError
from tests.reliability.helpers import engine_dirs
from tests.runtime_helpers import (
    DEATH_BOUND_S,
    assert_nothing_left,
    engine_config,
    live_children,
    open_fds,
    pid_alive,
    settled_thread_count,
    shm_segments,
    wait_pids_gone,
    worker_pids,
)
from worker.kv_cache import KVCacheTooSmallError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def engine_ipc_dirs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private, empty temp directory (a short path: sockets live under it) for this
    process's new temp files and its children: an engine started in a child interpreter
    keeps everything there, and a test checks it is empty afterwards. For engines of
    this process, whose multiprocessing temp dir exists already, `engine_dirs` lists
    the private directories wherever they are."""
    from tests.reliability.helpers import short_tmpdir

    # This interpreter's multiprocessing temp dir (its forkserver's socket and the
    # engines' private directories) is made once and kept for its life: not in here.
    multiprocessing.util.get_temp_dir()
    root = short_tmpdir()
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _assert_failed_start_left_nothing(children_before: set[int], shm_before: set[str], tmpdir: Path,
                                      dirs_before: set[str]) -> None:
    from tests.reliability.helpers import engine_dirs, sockets_left

    deadline = time.monotonic() + DEATH_BOUND_S
    while live_children() - children_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_children() - children_before, "worker processes left after a failed start-up"
    assert shm_segments() == shm_before, "shared-memory segments left after a failed start-up"
    left = sockets_left()
    assert not left, f"sockets left after a failed start-up: {left}"
    assert engine_dirs() <= dirs_before, f"private directories left after a failed start-up: {engine_dirs() - dirs_before}"
    left = sorted(p.name for p in tmpdir.iterdir())
    assert not left, f"left in the temp directory after a failed start-up: {left}"


# ---------------------------------------------------------------- a worker dies


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_worker_gives_engine_dead_error(tiny_models, victim):
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    try:
        pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
        assert core.collective_rpc("check_health") == [True, True]
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError) as info:
            # Calls may still go through until the death is noticed; then they raise.
            # (timeout: a missed death fails the test instead of hanging it)
            while time.monotonic() - killed_at < 2 * DEATH_BOUND_S:
                core.collective_rpc("check_health", timeout=2 * DEATH_BOUND_S)
                time.sleep(0.05)
        noticed_after = time.monotonic() - killed_at
        assert noticed_after < DEATH_BOUND_S, f"the dead rank was noticed only after {noticed_after:.1f}s"
        msg = str(info.value)
        assert f"rank {victim}" in msg and str(pids[victim]) in msg, msg
        assert str(-signal.SIGKILL) in msg, msg  # the exit code

        # Dead for good: every later call fails at once with the same reason.
        for call in (lambda: core.collective_rpc(lambda w: w.rank), core.check_health,
                     lambda: core.collective_rpc("check_health", unique_reply_rank=1 - victim)):
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match=f"rank {victim}"):
                call()
            assert time.monotonic() - start < DEATH_BOUND_S
    finally:
        core.shutdown()
    assert_nothing_left(pids, ipc_dir, shm_before)


def test_sigkill_worker_during_a_call(tiny_models):
    """A call blocked on a healthy rank is woken when another rank dies."""
    shm_before = shm_segments()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    try:
        pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir

        def busy(worker):
            time.sleep(60 if worker.rank == 0 else 0.0)
            return worker.rank

        killed_at: list[float] = []

        def kill_rank1_soon():
            time.sleep(0.5)
            os.kill(pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())

        killer = threading.Thread(target=kill_rank1_soon)
        killer.start()
        with pytest.raises(EngineDeadError, match="rank 1"):
            core.collective_rpc(busy, timeout=30)
        killer.join()
        assert time.monotonic() - killed_at[0] < DEATH_BOUND_S
    finally:
        core.shutdown()
    # Rank 0 was still inside the 60 s call: shutdown must not wait for it.
    assert_nothing_left(pids, ipc_dir, shm_before)


# ---------------------------------------------------------------- the engine dies

_ENGINE_SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    sys.path.insert(0, {repo!r})

    if __name__ == "__main__":
        from engine.core import EngineCore
        from tests.runtime_helpers import engine_config

        model, mode = sys.argv[1], sys.argv[2]
        core = EngineCore(engine_config(model, tp=2))
        print("PIDS", *[p.pid for p in core.model_executor.processes], flush=True)
        print("IPC", core.model_executor._ipc_dir, flush=True)
        print("READY", flush=True)
        if mode == "sleep":
            time.sleep(600)
        # mode "exit": leave with the engine still referenced; shutdown runs at exit.
    """
)


def _start_engine_script(tmp_path: Path, model: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "engine_script.py"
    script.write_text(_ENGINE_SCRIPT.format(repo=str(REPO)))
    stderr_path = tmp_path / "engine_script.stderr"
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, str(script), str(model), mode],
                                stdout=subprocess.PIPE, stderr=stderr, cwd=tmp_path)
    return proc, stderr_path


def _parse_ready(lines: list[str]) -> tuple[list[int], str]:
    pids = [int(p) for p in next(line for line in lines if line.startswith("PIDS")).split()[1:]]
    ipc_dir = next(line for line in lines if line.startswith("IPC")).split(maxsplit=1)[1]
    return pids, ipc_dir


def _read_until_ready(proc: subprocess.Popen, timeout: float) -> list[str]:
    lines: list[str] = []
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while "READY" not in lines:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the engine script did not print READY in {timeout}s; got {lines}")
            if not sel.select(timeout=min(remaining, 1.0)):
                if proc.poll() is not None:
                    raise RuntimeError(f"the engine script exited with {proc.returncode}; got {lines}")
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the engine script closed stdout (rc {proc.wait()}); got {lines}")
            buf += chunk
            *done, buf = buf.split(b"\n")
            lines += [line.decode().strip() for line in done]
    finally:
        sel.close()
    return lines


def _wait_ready(proc: subprocess.Popen, stderr_path: Path) -> tuple[list[int], str]:
    """The engine script's worker pids and private dir once it printed READY; a test
    failure with the script's stderr if it never did."""
    try:
        lines = _read_until_ready(proc, timeout=240)
    except (TimeoutError, RuntimeError) as e:
        pytest.fail(f"{e}\nstderr:\n{stderr_path.read_text()[-5000:]}")
    return _parse_ready(lines)


def test_sigkill_engine_process_kills_workers(tiny_models, tmp_path, engine_ipc_dirs):
    proc, stderr_path = _start_engine_script(tmp_path, tiny_models["llama"], "sleep")
    ipc_dir = None
    try:
        pids, ipc_dir = _wait_ready(proc, stderr_path)
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        # Everything the engine process started: the workers and multiprocessing's helpers.
        descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert set(pids) <= set(descendants)

        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=30)
        alive = wait_pids_gone(pids, timeout=DEATH_BOUND_S)
        assert not alive, f"workers {alive} outlived the SIGKILLed engine by {DEATH_BOUND_S}s"
        assert time.monotonic() - killed_at < DEATH_BOUND_S + 1
        alive = wait_pids_gone(descendants, timeout=DEATH_BOUND_S)
        assert not alive, f"helper processes {alive} outlived the SIGKILLed engine"
        # The queues' segments were unlinked as soon as every rank attached: none can leak.
        assert not shm_segments(proc.pid)
        # The workers and the forkserver remove the dead engine's directories on their way
        # out: its private one (socket files) and multiprocessing's pymp-* around it.
        assert ipc_dir.startswith(str(engine_ipc_dirs) + "/"), ipc_dir
        left = sorted(str(p.relative_to(engine_ipc_dirs)) for p in engine_ipc_dirs.rglob("*"))
        assert not left, f"the SIGKILLed engine left {left} in its temp directory"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_interpreter_exit_shuts_down(tiny_models, tmp_path, engine_ipc_dirs):
    proc, stderr_path = _start_engine_script(tmp_path, tiny_models["llama"], "exit")
    try:
        pids, ipc_dir = _wait_ready(proc, stderr_path)
        assert proc.wait(timeout=120) == 0, stderr_path.read_text()[-5000:]
        stderr = stderr_path.read_text()
        assert "Traceback" not in stderr and "leaked" not in stderr, stderr[-5000:]
        assert_nothing_left(pids, ipc_dir, set(), creator_pid=proc.pid)
        assert list(engine_ipc_dirs.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- shutdown leaks nothing


def test_shutdown_leaves_no_process_segment_or_socket(tiny_models):
    from tests.reliability.helpers import assert_nothing_left as assert_nothing_left_or_socket
    from tests.reliability.helpers import queue_sockets

    shm_before = shm_segments()
    children_before = live_children()
    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
    assert set(pids) <= live_children()
    # The private dir really holds the sockets while the engine runs.
    assert {s.rsplit(".", 1)[-1] for s in queue_sockets()} == {"data"}, queue_sockets()
    assert all(name.startswith(ipc_dir + "/") for name in queue_sockets())
    assert any(name.endswith(".data") for name in os.listdir(ipc_dir)), os.listdir(ipc_dir)
    assert any(".wake" in name for name in os.listdir(ipc_dir)), os.listdir(ipc_dir)  # the wake-up FIFOs
    assert Path(ipc_dir).stat().st_mode & 0o077 == 0, "the IPC dir must be private"
    core.shutdown()
    # ZeroMQ closes a socket's descriptor on its I/O thread, just after close() returns;
    # the reliability helper waits (up to 5 s) for the kernel to drop it.
    assert_nothing_left_or_socket(pids, ipc_dir, shm_before)
    assert live_children() <= children_before
    core.shutdown()  # idempotent
    with pytest.raises(EngineDeadError):
        core.check_health()


def test_start_stop_20_times_leaks_nothing(tiny_models):
    model = tiny_models["llama"]
    # Warm up once: the forkserver, resource tracker, zmq context and imports are created
    # on first use and shared by every later engine of this interpreter.
    with EngineCore(engine_config(model, tp=2)) as core:
        pids = worker_pids(core)
    assert not wait_pids_gone(pids)
    gc.collect()
    shm_before = shm_segments()
    children_before = live_children()
    threads_before = settled_thread_count(threading.active_count())
    fds_before = open_fds()

    for i in range(20):
        core = EngineCore(engine_config(model, tp=2))
        pids, ipc_dir = worker_pids(core), core.model_executor._ipc_dir
        assert core.collective_rpc("check_health") == [True, True], f"start {i}"
        core.shutdown()
        del core
        assert_nothing_left(pids, ipc_dir, shm_before)

    gc.collect()
    assert live_children() <= children_before
    assert shm_segments() == shm_before
    from tests.reliability.helpers import queue_sockets

    assert not queue_sockets()
    fds_after = open_fds()
    assert fds_after - fds_before <= 4, f"fds grew from {fds_before} to {fds_after} over 20 engines"
    threads_after = settled_thread_count(threads_before)
    assert threads_after <= threads_before, (
        f"threads grew from {threads_before} to {threads_after}: {[t.name for t in threading.enumerate()]}"
    )


# ---------------------------------------------------------------- start-up failures


def test_corrupt_shard_fails_startup_cleanly(copy_model, engine_ipc_dirs):
    model = copy_model("llama")
    shard = model / "model-00002-of-00002.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    shm_before, children_before, dirs_before = shm_segments(), live_children(), engine_dirs()

    with pytest.raises(WorkerStartupError) as info:
        EngineCore(engine_config(model, tp=2))
    msg = str(info.value)
    assert str(shard) in msg, msg
    assert "truncated" in msg
    assert "remote traceback" in msg and "load_model" in msg  # the worker's own traceback
    _assert_failed_start_left_nothing(children_before, shm_before, engine_ipc_dirs, dirs_before)


def test_bad_tokenizer_fails_startup_cleanly(copy_model, engine_ipc_dirs):
    """A failure after the workers are up (here: the tokenizer) still stops them."""
    model = copy_model("llama")
    (model / "tokenizer.json").write_text("{not json")
    shm_before, children_before, dirs_before = shm_segments(), live_children(), engine_dirs()
    with pytest.raises(Exception) as info:
        EngineCore(engine_config(model, tp=2))
    # Checked while the exception (and the half-built core in its traceback) is alive.
    _assert_failed_start_left_nothing(children_before, shm_before, engine_ipc_dirs, dirs_before)
    del info


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_too_small(tiny_models, engine_ipc_dirs, tp):
    shm_before, children_before, dirs_before = shm_segments(), live_children(), engine_dirs()
    config = engine_config(tiny_models["llama"], tp=tp, kv_cache_memory_bytes=1024)
    with pytest.raises(KVCacheTooSmallError) as info:
        EngineCore(config)
    msg = str(info.value)
    block_bytes = 2 * 2 * 16 * (2 // tp) * 16 * 4  # layers * K/V * block_size * kv heads * head_dim * fp32
    assert "max_model_len=128" in msg, msg
    assert f"needs 8 blocks of {block_bytes} bytes" in msg, msg
    assert "1024 bytes" in msg and "0 blocks" in msg and "kv_cache_memory_bytes (now 1024)" in msg, msg
    if tp > 1:
        _assert_failed_start_left_nothing(children_before, shm_before, engine_ipc_dirs, dirs_before)
    else:
        assert live_children() <= children_before


# ---------------------------------------------------------------- a failure on a silent rank


def test_failure_on_a_rank_that_was_not_asked_is_reported_at_once(tiny_models):
    from executor.errors import RemoteWorkerError
    from tests.runtime_helpers import fail_on_rank_1_while_rank_0_waits

    core = EngineCore(engine_config(tiny_models["llama"], tp=2))
    try:
        start = time.monotonic()
        with pytest.raises(RemoteWorkerError, match="boom on rank 1") as info:
            core.collective_rpc(fail_on_rank_1_while_rank_0_waits, unique_reply_rank=0, timeout=120)
        assert info.value.rank == 1
        assert "fail_on_rank_1_while_rank_0_waits" in info.value.remote_traceback
        assert time.monotonic() - start < DEATH_BOUND_S
        # Rank 0 is still in the barrier rank 1 left: the group is out of step. The next
        # call says so (it used to never return), and so does every call after it.
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) \[0\] can never finish"):
            core.collective_rpc("check_health", timeout=120)
        assert time.monotonic() - start < DEATH_BOUND_S
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                core.collective_rpc("check_health", timeout=120)
            assert time.monotonic() - start < 1.0
    finally:
        pids = worker_pids(core)
        core.shutdown()
    assert not wait_pids_gone(pids, timeout=DEATH_BOUND_S)
