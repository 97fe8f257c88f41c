"""The engine process itself dies (SIGKILL, SIGTERM) while serving or while a rank is
stuck; the host lacks room in /dev/shm or a usable temp directory at start-up; and the
CPU's default KV budget (issue 12).

The engine runs in a child interpreter whose TMPDIR is a private empty directory, so
"nothing remains on disk" is checked for real: no private dir, socket file or
forkserver `pymp-*` dir, no /dev/shm segment and no socket of that engine pid, and no
worker or helper process.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.reliability.helpers import queue_sockets, short_tmpdir
from tests.runtime_helpers import DEATH_BOUND_S, live_children, pid_alive, shm_segments, wait_pids_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    sys.path.insert(0, {repo!r})

    if __name__ == "__main__":
        from engine.core import EngineCore
        from config import SamplingParams
        from tests.reliability.helpers import arm_forward_fault
        from tests.runtime_helpers import engine_config

        model, mode = sys.argv[1], sys.argv[2]
        # liveness off: a stuck rank must stay stuck until the engine is killed
        core = EngineCore(engine_config(model, tp=2, worker_liveness_timeout_s=0))
        params = SamplingParams(max_tokens=64, temperature=0.0)
        core.generate([[1, 2, 3]], params)
        if mode == "stuck":
            core.collective_rpc(arm_forward_fault, args=(1, "hang", 1))
        print("PIDS", *[p.pid for p in core.model_executor.processes], flush=True)

        def serve():
            while True:
                core.generate([[1, 2, 3], [4, 5]], params)

        threading.Thread(target=serve, daemon=True).start()
        time.sleep(0.5)
        print("READY", flush=True)
        time.sleep(600)
    """
)


def _read_until(proc: subprocess.Popen, word: str, timeout: float) -> list[str]:
    lines: list[str] = []
    buf = b""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while word not in lines:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"no {word} from the engine script (rc {proc.poll()}); got {lines}")
            if not sel.select(timeout=0.5):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            buf += chunk
            *done, buf = buf.split(b"\n")
            lines += [line.decode().strip() for line in done]
    finally:
        sel.close()
    return lines


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("mode", ["serving", "stuck"])
def test_engine_killed_leaves_nothing(tiny_models, tmp_path, mode, sig):
    engine_tmp = short_tmpdir()
    script = tmp_path / "engine_script.py"
    script.write_text(_SCRIPT.format(repo=str(REPO)))
    stderr_path = tmp_path / "stderr"
    env = {**os.environ, "TMPDIR": str(engine_tmp)}
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, str(script), str(tiny_models["llama"]), mode],
                                stdout=subprocess.PIPE, stderr=stderr, cwd=tmp_path, env=env)
    try:
        try:
            lines = _read_until(proc, "READY", timeout=180)
        except RuntimeError as e:
            pytest.fail(f"{e}\n{stderr_path.read_text()[-4000:]}")
        pids = [int(p) for p in next(line for line in lines if line.startswith("PIDS")).split()[1:]]
        descendants = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert set(pids) <= set(descendants) and all(pid_alive(p) for p in pids)
        listening = queue_sockets(proc.pid)
        assert listening and all(not name.startswith("@") for name in listening), listening
        assert any(p.name.startswith("pymp-") for p in engine_tmp.iterdir())  # the forkserver's, and ours inside

        os.kill(proc.pid, sig)
        killed_at = time.monotonic()
        proc.wait(timeout=30)
        alive = wait_pids_gone(pids, timeout=DEATH_BOUND_S)
        workers_gone = time.monotonic() - killed_at
        assert not alive, f"workers {alive} outlived the engine ({sig.name}, {mode})"
        alive = wait_pids_gone(descendants, timeout=DEATH_BOUND_S)
        all_gone = time.monotonic() - killed_at
        assert not alive, f"helper processes {alive} outlived the engine ({sig.name}, {mode})"
        print(f"\nFIGURE engine {sig.name} while {mode}: workers gone after {workers_gone:.2f}s, "
              f"forkserver and resource tracker after {all_gone:.2f}s", flush=True)
        assert not shm_segments(proc.pid), shm_segments(proc.pid)
        deadline = time.monotonic() + 5
        while queue_sockets(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not queue_sockets(proc.pid), queue_sockets(proc.pid)
        left = sorted(str(p.relative_to(engine_tmp)) for p in engine_tmp.rglob("*"))
        assert not left, f"the {sig.name}ed engine left {left} in its temp directory"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(engine_tmp, ignore_errors=True)


# ---------------------------------------------------------------- start-up without room


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    """A 4 MiB tmpfs, filled to the last byte (needs root to mount; skipped otherwise)."""
    mnt = tmp_path / "tiny_shm"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with open(mnt / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_shm_fails_startup_naming_it(tiny_models, full_tmpfs, monkeypatch, tmp_path):
    from engine.core import EngineCore
    from executor.errors import ShmSpaceError
    from tests.runtime_helpers import engine_config

    st = os.statvfs(full_tmpfs)
    assert st.f_bavail * st.f_frsize < 65536, "the tmpfs should be full"
    monkeypatch.setenv("TP_SHM_DIR", str(full_tmpfs))
    shm_before, children_before = shm_segments(), live_children()
    start = time.monotonic()
    with pytest.raises(ShmSpaceError) as info:
        EngineCore(engine_config(tiny_models["llama"], tp=2))
    msg = str(info.value)
    assert str(full_tmpfs) in msg and "bytes free" in msg and "needs" in msg, msg
    assert "tensor_parallel_size=2" in msg and "--shm-size" in msg, msg
    assert time.monotonic() - start < DEATH_BOUND_S
    assert live_children() <= children_before and shm_segments() == shm_before
    assert not queue_sockets()


def test_unwritable_tmpdir_fails_startup_naming_it(tiny_models, tmp_path):
    """TMPDIR set to a directory that cannot be written (a read-only mount; a 0500
    directory when not root): start-up fails at once with TempDirError naming it, and
    nothing is started (in a child interpreter, whose multiprocessing temp dir is not
    made yet)."""
    ro = tmp_path / "readonly_tmp"
    ro.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True).returncode == 0
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root ignores directory modes and cannot mount here")
        ro.chmod(0o500)
    try:
        code = textwrap.dedent(f"""
            import sys, os
            sys.path.insert(0, {str(REPO)!r})
            if __name__ == "__main__":
                from engine.core import EngineCore
                from executor.errors import TempDirError
                from tests.runtime_helpers import engine_config, live_children
                try:
                    EngineCore(engine_config({str(tiny_models["llama"])!r}, tp=2))
                except TempDirError as e:
                    print("ERROR", e)
                    print("CHILDREN", len(live_children()))
                else:
                    sys.exit("started anyway")
        """)
        script = tmp_path / "ro_script.py"
        script.write_text(code)
        res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                             env={**os.environ, "TMPDIR": str(ro)}, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-4000:] + res.stdout
        assert f"TMPDIR={str(ro)!r} is not a writable directory" in res.stdout, res.stdout
        assert "CHILDREN 0" in res.stdout, res.stdout
        assert list(ro.iterdir()) == []
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ro)], check=False)
        else:
            ro.chmod(0o700)


# ---------------------------------------------------------------- the CPU's default KV budget


def test_cpu_default_kv_budget_is_fixed_and_overridable(tiny_models):
    from config import CPU_DEFAULT_KV_CACHE_BYTES
    from engine.arg_utils import create_engine_config
    from engine.core import EngineCore

    model = str(tiny_models["llama"])
    assert CPU_DEFAULT_KV_CACHE_BYTES == 1 << 30
    assert create_engine_config(model=model, device="cpu").cache_config.kv_cache_memory_bytes == CPU_DEFAULT_KV_CACHE_BYTES
    assert create_engine_config(model=model, device="cpu", kv_cache_memory_bytes=1 << 20).cache_config.kv_cache_memory_bytes \
        == 1 << 20
    # Asking for a share of memory (or a block count) keeps vLLM's rules.
    assert create_engine_config(model=model, device="cpu", gpu_memory_utilization=0.5).cache_config.kv_cache_memory_bytes \
        is None
    assert create_engine_config(model=model, device="cpu", num_gpu_blocks_override=8).cache_config.kv_cache_memory_bytes \
        is None

    # The library's default, end to end: 1 GiB of blocks, not 90% of the host's memory.
    core = EngineCore(model=model, device="cpu", dtype="float32", max_model_len=128, use_tqdm_on_load=False)
    try:
        spec_bytes = core.model_executor.get_kv_cache_spec().block_bytes
        assert core.kv_cache_config.num_blocks == CPU_DEFAULT_KV_CACHE_BYTES // spec_bytes
        assert core.startup_timings["profile"] < 1.0  # no profile run for a fixed budget
    finally:
        core.shutdown()
