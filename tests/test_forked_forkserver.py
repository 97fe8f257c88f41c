"""The forkserver forked from the engine process (executor/forked_forkserver.py).

Each case runs a script in a fresh interpreter, since a process starts its forkserver
once: a first engine there gets a forkserver that is a fork of the engine process
(same command line, the engine its parent), the ranks are its children, a second
engine reuses it, and the outputs equal the stock forkserver's. A process that has run
OpenMP threads, or runs another Python thread, gets the stock server instead, without
hanging. A SIGKILLed engine with a forked server leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import psutil
import pytest

from executor import forked_forkserver
from tests.reliability.helpers import assert_nothing_left, short_tmpdir
from tests.runtime_helpers import DEATH_BOUND_S, shm_segments, wait_pids_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    sys.path.insert(0, {repo!r})
    import psutil

    def cmdline(pid):
        with open(f"/proc/{{pid}}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\\0") if a]

    if __name__ == "__main__":
        model, mode = sys.argv[1], sys.argv[2]
        import torch
        from multiprocessing import forkserver
        from engine.core import EngineCore
        from config import SamplingParams
        from tests.runtime_helpers import engine_config

        if mode == "openmp":
            torch.set_num_threads(2)
            torch.ones(1 << 20).add_(1)  # one parallel region: GNU OpenMP's pool now exists
        if mode == "thread":
            threading.Thread(target=threading.Event().wait, daemon=True).start()
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
        report = {{"engine_cmdline": cmdline(os.getpid())}}
        core = EngineCore(engine_config(model, tp=2))
        # Under the spawn method the ranks are the engine's own children.
        server = os.getpid() if mode == "spawn" else forkserver._forkserver._forkserver_pid
        workers = [p.pid for p in core.model_executor.processes]
        report.update(server=server, server_cmdline=cmdline(server),
                      server_ppid=psutil.Process(server).ppid(),
                      worker_ppids=[psutil.Process(p).ppid() for p in workers],
                      tokens=[o.token_ids for o in core.generate(prompts, params)])
        if mode == "sleep":
            print("PIDS", server, *workers, flush=True)
            print("IPC", core.model_executor._ipc_dir, flush=True)
            time.sleep(600)
        core.shutdown()
        with EngineCore(engine_config(model, tp=2)) as second:
            report["second_server"] = forkserver._forkserver._forkserver_pid
            report["second_tokens"] = [o.token_ids for o in second.generate(prompts, params)]
        print("REPORT " + json.dumps(report), flush=True)
    """
)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "engine_script.py"
    path.write_text(_SCRIPT.format(repo=str(REPO)))
    return path


def _run(tmp_path: Path, model: Path, mode: str, **env: str) -> dict:
    tmpdir = short_tmpdir()
    try:
        proc = subprocess.run([sys.executable, str(_script(tmp_path)), str(model), mode], cwd=tmp_path,
                              capture_output=True, text=True, timeout=240,
                              env={**os.environ, "TMPDIR": str(tmpdir), **env})
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
        left = sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*"))
        assert not left, f"left in the temp directory: {left}"
        return json.loads(line[len("REPORT "):])
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _stock(report: dict) -> bool:
    return any("multiprocessing.forkserver import main" in a for a in report["server_cmdline"])


def test_first_engine_forks_its_forkserver_and_outputs_match_the_stock_one(tiny_models: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    forked = _run(tmp_path, tiny_models["llama"], "plain")
    assert forked["server_cmdline"] == forked["engine_cmdline"], forked
    assert not _stock(forked)
    assert forked["server_ppid"] != forked["server"]
    assert forked["worker_ppids"] == [forked["server"]] * 2  # the ranks fork from it, not from the engine
    assert forked["second_server"] == forked["server"]  # a later engine reuses it
    assert forked["second_tokens"] == forked["tokens"]

    spawned = _run(tmp_path, tiny_models["llama"], "openmp")
    assert _stock(spawned), spawned["server_cmdline"]
    assert spawned["tokens"] == forked["tokens"]
    assert spawned["second_server"] == spawned["server"]


def test_another_python_thread_gets_the_stock_forkserver(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    report = _run(tmp_path, tiny_models["llama"], "thread")
    assert _stock(report), report["server_cmdline"]
    assert report["worker_ppids"] == [report["server"]] * 2


def test_spawn_method_forks_no_forkserver(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    report = _run(tmp_path, tiny_models["llama"], "spawn", TP_WORKER_MULTIPROC_METHOD="spawn")
    assert report["worker_ppids"] == [report["server"]] * 2  # children of the engine itself
    assert report["second_server"] is None  # no forkserver was started


def test_sigkilled_engine_with_a_forked_forkserver_leaves_nothing(tiny_models: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    tmpdir = short_tmpdir()
    shm_before = shm_segments()
    proc = subprocess.Popen([sys.executable, str(_script(tmp_path)), str(tiny_models["llama"]), "sleep"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TMPDIR": str(tmpdir)})
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        pids = [int(p) for p in lines[0].split()[1:]]
        ipc_dir = lines[1].split(maxsplit=1)[1].strip()
        server = pids[0]
        assert psutil.Process(server).ppid() == proc.pid
        assert psutil.Process(server).cmdline() == psutil.Process(proc.pid).cmdline()  # forked
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        left = wait_pids_gone(pids, DEATH_BOUND_S)
        assert not left, f"left running: {left} (forkserver {server}, ranks {pids[1:]})"
        assert_nothing_left(pids, ipc_dir, shm_before, creator_pid=proc.pid, tmpdir=tmpdir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_declines_where_a_fork_is_unsafe() -> None:
    # A server that has not started, whatever this process's own forkserver is doing.
    server = types.SimpleNamespace(_lock=threading.Lock(), _forkserver_pid=None, _forkserver_address=None,
                                   _forkserver_alive_fd=None)
    preload = ["torch"]
    assert forked_forkserver._unsafe_reason(server, preload, "cpu") in (None, f"{threading.active_count()} Python threads run")
    assert "device 'cuda'" in (forked_forkserver._unsafe_reason(server, preload, "cuda") or "")
    assert "not imported" in (forked_forkserver._unsafe_reason(server, ["no_such_module_xyz"], "cpu") or "")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "Python threads run" in (forked_forkserver._unsafe_reason(server, preload, "cpu") or "")
        assert forked_forkserver.start_forked_forkserver(preload, "cpu") is False
    finally:
        stop.set()
        thread.join()
