"""The project as a user installs it: the wheel built from this checkout, installed into a
fresh virtual environment, serving the demo from a directory outside the checkout.

CI installs the project in editable mode (`pip install -e`), which imports every module and
reads every C kernel source straight from the checkout, so a file that pyproject.toml's
package data misses is invisible there; a user who installs the wheel gets no
`shm_allreduce.c`, and the communicator silently falls back to its slower torch-op path.
These tests see what the wheel holds and what its installed copy does.

The module fixture builds the wheel once (from a copy of the checkout's files, so the
build's `build/` and `*.egg-info` land in the copy) and installs it into one virtual
environment; everything lives under one temporary directory that is removed afterwards,
failures included. No network: pip runs with `--no-index`, the server on loopback.

The virtual environment has `--system-site-packages`, to reuse the installed torch and
friends without an index, so it also sees this project's editable install. That finder
(setuptools' `__editable___*_finder`) is appended to `sys.meta_path`, behind the
ordinary path finder, and the venv's site-packages precedes the system's on `sys.path`:
the wheel's copy wins. `test_the_venv_imports_the_wheels_copy` checks exactly that.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from tests.conftest import REPO, free_port

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (requires-python allows it): pip's copy, pip being needed here anyway
    from pip._vendor import tomli as tomllib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STARTUP_TIMEOUT_S = 240.0
DEMO_MODEL_NAME = "tp-runtime-demo"
TP = 2


def _runtime_packages() -> list[str]:
    """The top-level packages the wheel ships: pyproject's `packages.find.include` globs
    ("engine*" -> "engine"), read from the file so that the list lives in one place."""
    with (REPO / "pyproject.toml").open("rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in include]


def _checkout_files() -> list[str]:
    """Every file of the checkout that git tracks or would track (untracked, not ignored),
    that exists in the working tree: what a commit of this tree would hold."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout.decode()
    return sorted(name for name in set(out.split("\0")) if name and (REPO / name).is_file())


def _build_artifacts() -> dict[str, int]:
    """The checkout's top-level build outputs (`build/`, `*.egg-info`), with their mtimes."""
    return {entry.name: entry.stat().st_mtime_ns for entry in os.scandir(REPO)
            if entry.name == "build" or entry.name.endswith(".egg-info")}


def _offline_env(**extra: str) -> dict[str, str]:
    """os.environ without PYTHONPATH (which could put the checkout on `sys.path`), with pip
    kept off every index."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def _run(cmd: list[str | Path], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@dataclass
class Installed:
    """The built wheel and the virtual environment it is installed into."""

    root: Path  # the temporary directory holding everything below; outside the checkout
    wheel: Path
    expected: list[str]  # the checkout's files under the runtime packages
    artifacts_before: dict[str, int]
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def workdir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir()
        return path


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    artifacts_before = _build_artifacts()
    with tempfile.TemporaryDirectory(prefix="tp-packaging-") as tmp:
        root = Path(tmp).resolve()
        assert not root.is_relative_to(REPO.resolve())
        env = _offline_env()
        files = _checkout_files()
        src = root / "src"
        for name in files:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
        wheels = root / "wheels"
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels,
              src], cwd=root, env=env)
        [wheel] = wheels.glob("*.whl")
        venv = root / "venv"
        # No pip of its own (ensurepip would take seconds): the system's pip, visible
        # through --system-site-packages, installs into the interpreter that runs it.
        _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=root, env=env)
        _run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall",
              wheel], cwd=root, env=env)
        packages = tuple(f"{p}/" for p in _runtime_packages())
        yield Installed(root, wheel, [name for name in files if name.startswith(packages)], artifacts_before, venv)


def test_the_wheel_ships_every_runtime_file(installed: Installed) -> None:
    shipped = set(zipfile.ZipFile(installed.wheel).namelist())
    sources = [name for name in installed.expected if name.endswith(".c")]
    # The four CPU kernels as of writing; the glob finds any added since.
    assert len(sources) >= 4 and "distributed/device_communicators/shm_allreduce.c" in sources, sources
    assert any(name.endswith(".py") for name in installed.expected)
    missing = [name for name in installed.expected if name not in shipped]
    assert not missing, f"files of the runtime packages the wheel lacks (pyproject.toml's package-data): {missing}"
    # The build ran in a copy: the checkout gained no build/ or *.egg-info, nor touched one.
    assert _build_artifacts() == installed.artifacts_before


def test_the_venv_imports_the_wheels_copy(installed: Installed) -> None:
    packages = _runtime_packages()
    probe = ("import importlib, json, sysconfig\n"
             f"files = {{n: importlib.import_module(n).__file__ for n in {packages!r}}}\n"
             "from distributed.device_communicators import shm_allreduce\n"
             "files['shm_allreduce.c'] = str(shm_allreduce.KERNEL_SOURCE)\n"
             "print(json.dumps({'purelib': sysconfig.get_paths()['purelib'], 'files': files}))\n")
    out = json.loads(_run([installed.python, "-c", probe], cwd=installed.workdir("probe"), env=_offline_env()))
    purelib = Path(out["purelib"]).resolve()
    assert purelib.is_relative_to(installed.venv)
    for name, file in out["files"].items():
        path = Path(file).resolve()
        assert path.is_relative_to(purelib) and path.is_file(), f"{name} imported from {path}, not the wheel's copy"

    script = installed.venv / "bin" / "tp-runtime"
    assert script.read_text().startswith(f"#!{installed.python}")
    help_text = _run([script, "serve", "--help"], cwd=installed.root, env=_offline_env())
    assert help_text.startswith("usage: tp-runtime serve") and "--served-model-name" in help_text


def _descendants(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_all(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server and everything under it (a failed test's cleanup)."""
    if proc.poll() is None:
        children = _descendants(proc)
        proc.kill()
        proc.wait(timeout=30)
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def _start_server(installed: Installed, cwd: Path, env: dict[str, str], log_path: Path
                  ) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m engine.serve --tp 2 --device cpu` in the venv, ready (`/health` 200);
    retried on a port taken between picking and binding. The caller stops it."""
    for _ in range(3):
        url = f"http://127.0.0.1:{(port := free_port())}"
        with log_path.open("ab") as log:
            proc = subprocess.Popen([str(installed.python), "-m", "engine.serve", "--tp", str(TP), "--device", "cpu",
                                     "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
                                    cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        _kill_all(proc)
        if "address already in use" not in log_path.read_text(errors="replace").lower():
            break
    raise AssertionError(f"server did not become ready; exit code {proc.poll()}; log:\n"
                         f"{log_path.read_text(errors='replace')}")


def _kernel_mappers(processes: list[psutil.Process], kernels: Path) -> list[int]:
    """The pids among `processes` that have a shm_allreduce library from `kernels` mapped."""
    pids = []
    for p in processes:
        try:
            if any(Path(m.path).parent == kernels and Path(m.path).name.startswith("shm_allreduce-")
                   for m in p.memory_maps()):
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return pids


def test_the_installed_wheel_serves_the_demo_with_the_shm_kernel(installed: Installed) -> None:
    cwd, cache = installed.workdir("serve"), installed.root / "cache"
    log_path = installed.root / "server.log"
    env = _offline_env(TP_RUNTIME_CACHE=str(cache))
    proc, url = _start_server(installed, cwd, env, log_path)
    try:
        log = lambda: log_path.read_text(errors="replace")  # noqa: E731
        children = _descendants(proc)
        assert (cache / "demo-model" / "config.json").is_file(), log()
        # The all-reduce's C kernel was compiled from the installed shm_allreduce.c into
        # this fresh cache, and every rank has it loaded: without the source in the wheel
        # there is no library, only a warning and the torch-op path.
        assert list((cache / "kernels").glob("shm_allreduce-*.so")), log()
        assert len(_kernel_mappers(children, (cache / "kernels").resolve())) == TP, log()

        body = {"model": DEMO_MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["model"] == DEMO_MODEL_NAME and answer["usage"]["completion_tokens"] == 4, answer
        assert isinstance(answer["choices"][0]["text"], str) and answer["choices"][0]["finish_reason"] == "length"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log()
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"left running: {alive}"
    finally:
        _kill_all(proc)
