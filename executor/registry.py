"""distributed_executor_backend name -> Executor class. Built-ins are imported lazily, by name.

Importing this module imports nothing heavy (no torch, no ZeroMQ), so config
validation can call ``get_supported_executor_backends()`` at any time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from executor.abstract import Executor

__all__ = ["get_executor_backend_cls", "get_supported_executor_backends", "register_executor_backend"]

_BUILTIN_BACKENDS: dict[str, str] = {
    "uni": "executor.uniproc_executor:UniProcExecutor",
    "mp": "executor.multiproc_executor:MultiprocExecutor",
    # One Ray actor per rank, on a local or multi-node Ray cluster (needs the "ray" extra).
    "ray": "executor.ray_distributed_executor:RayDistributedExecutor",
    # Under torchrun: each rank's own EngineCore drives its in-process worker.
    "external_launcher": "executor.external_launcher_executor:ExternalLauncherExecutor",
}
_USER_BACKENDS: dict[str, type["Executor"]] = {}

T = TypeVar("T", bound="type[Executor]")


def register_executor_backend(name: str) -> Callable[[T], T]:
    """Class decorator: ``@register_executor_backend("mine")`` makes
    ``distributed_executor_backend="mine"`` use it (a user's name wins over a built-in).

    Only the engine's process resolves backends, so registering there, before the
    engine is built, is enough. Raises TypeError if the class is not an Executor.
    """

    def wrap(cls: T) -> T:
        from executor.abstract import Executor

        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"{cls!r} must subclass Executor to be registered as {name!r}")
        _USER_BACKENDS[name] = cls
        return cls

    return wrap


def get_supported_executor_backends() -> list[str]:
    """Every registered backend name, sorted."""
    return sorted({*_BUILTIN_BACKENDS, *_USER_BACKENDS})


def get_executor_backend_cls(name: str) -> type["Executor"]:
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
