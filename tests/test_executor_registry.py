"""Tests for executor.registry and Executor.get_class: backends by name, lazily imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest

import executor.registry as registry
from executor.abstract import Executor, register_executor_backend
from executor.registry import get_executor_backend_cls, get_supported_executor_backends

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(backend: Any, world_size: int = 1) -> Any:
    # get_class reads only these two fields.
    return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend, world_size=world_size))


class _NullExecutor(Executor):
    def _init_executor(self) -> None:
        pass

    def collective_rpc(self, method: Any, args: Any = (), kwargs: Any = None, timeout: Any = None,
                       unique_reply_rank: Any = None) -> Any:
        return None

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _no_user_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_USER_BACKENDS", {})


def test_registered_name_resolves() -> None:
    assert register_executor_backend("null")(_NullExecutor) is _NullExecutor
    assert "null" in get_supported_executor_backends()
    assert get_executor_backend_cls("null") is _NullExecutor
    assert Executor.get_class(_config("null", world_size=4)) is _NullExecutor


def test_unknown_name_lists_the_registered_backends() -> None:
    register_executor_backend("null")(_NullExecutor)
    with pytest.raises(ValueError, match=r"'nope'.*\['external_launcher', 'mp', 'null', 'ray', 'uni'\]"):
        Executor.get_class(_config("nope"))


def test_only_executors_register_and_classes_pass_through() -> None:
    with pytest.raises(TypeError):
        register_executor_backend("bad")(dict)  # type: ignore[type-var]
    assert "bad" not in get_supported_executor_backends()
    assert Executor.get_class(_config(_NullExecutor)) is _NullExecutor
    with pytest.raises(TypeError):
        Executor.get_class(_config(dict))


def test_builtins_resolve_by_name_and_by_default() -> None:
    from executor.multiproc_executor import MultiprocExecutor
    from executor.ray_distributed_executor import RayDistributedExecutor
    from executor.uniproc_executor import UniProcExecutor

    assert get_supported_executor_backends() == ["external_launcher", "mp", "ray", "uni"]
    assert Executor.get_class(_config("uni")) is UniProcExecutor
    assert Executor.get_class(_config("mp")) is MultiprocExecutor
    assert Executor.get_class(_config("ray", world_size=2)) is RayDistributedExecutor
    assert Executor.get_class(_config(None, world_size=1)) is UniProcExecutor
    assert Executor.get_class(_config(None, world_size=2)) is MultiprocExecutor


_LAZY_SCRIPT = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace
    from executor.registry import get_supported_executor_backends
    assert get_supported_executor_backends() == ["external_launcher", "mp", "ray", "uni"]
    assert "torch" not in sys.modules and "zmq" not in sys.modules, "registry import is not light"
    from executor.abstract import Executor
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="uni", world_size=1))
    assert Executor.get_class(cfg).__name__ == "UniProcExecutor"
    assert "executor.multiproc_executor" not in sys.modules, "'mp' imported although 'uni' was chosen"
    """
)


@pytest.mark.slow
def test_registry_import_is_light_and_builtins_are_imported_only_when_chosen() -> None:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _LAZY_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
