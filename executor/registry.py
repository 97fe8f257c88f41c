"""distributed_executor_backend name -> Executor class. Built-ins are imported lazily, by name.

Importing this module imports nothing heavy (no torch, no ZeroMQ), so config
validation can call ``get_supported_executor_backends()`` at any time. It knows
classes only as classes: `executor.abstract.register_executor_backend`, which checks
that a class is an Executor, adds a user's here, and `Executor.get_class` looks names
up here (this module imports neither).
"""

from __future__ import annotations

import importlib

__all__ = ["add_executor_backend", "get_executor_backend_cls", "get_supported_executor_backends"]

_BUILTIN_BACKENDS: dict[str, str] = {
    "uni": "executor.uniproc_executor:UniProcExecutor",
    "mp": "executor.multiproc_executor:MultiprocExecutor",
    # One Ray actor per rank, on a local or multi-node Ray cluster (needs the "ray" extra).
    "ray": "executor.ray_distributed_executor:RayDistributedExecutor",
    # Under torchrun: each rank's own EngineCore drives its in-process worker.
    "external_launcher": "executor.external_launcher_executor:ExternalLauncherExecutor",
}
_USER_BACKENDS: dict[str, type] = {}


def add_executor_backend(name: str, cls: type) -> None:
    """Makes ``distributed_executor_backend=name`` resolve to `cls` (a user's name wins
    over a built-in). Called by `register_executor_backend` once it checked `cls`."""
    _USER_BACKENDS[name] = cls


def get_supported_executor_backends() -> list[str]:
    """Every registered backend name, sorted."""
    return sorted({*_BUILTIN_BACKENDS, *_USER_BACKENDS})


def get_executor_backend_cls(name: str) -> type:
    """The Executor class registered as ``name``; imports a built-in's module on first use.

    Raises ValueError naming the registered backends if ``name`` is unknown."""
    if name in _USER_BACKENDS:
        return _USER_BACKENDS[name]
    target = _BUILTIN_BACKENDS.get(name)
    if target is None:
        raise ValueError(
            f"distributed_executor_backend={name!r} is not valid; registered backends: "
            f"{get_supported_executor_backends()} (or pass an Executor subclass)"
        )
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
