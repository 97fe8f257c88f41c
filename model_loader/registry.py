"""load_format -> loader class. Built-in loaders are imported lazily, by name."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from model_loader.base_loader import BaseModelLoader

_BUILTIN_LOADERS: dict[str, str] = {
    "auto": "model_loader.default_loader:DefaultModelLoader",
    "hf": "model_loader.default_loader:DefaultModelLoader",
    "safetensors": "model_loader.default_loader:DefaultModelLoader",
    "pt": "model_loader.default_loader:DefaultModelLoader",
    "npcache": "model_loader.default_loader:DefaultModelLoader",
    "dummy": "model_loader.dummy_loader:DummyModelLoader",
    "sharded_state": "model_loader.sharded_state_loader:ShardedStateLoader",
    "gguf": "model_loader.gguf_loader:GGUFModelLoader",
}
_USER_LOADERS: dict[str, type["BaseModelLoader"]] = {}

T = TypeVar("T", bound="type[BaseModelLoader]")


def register_model_loader(load_format: str) -> Callable[[T], T]:
    """Class decorator: `@register_model_loader("mine")` makes `load_format="mine"` use it.

    Register at import time of a module that worker processes also import, so that
    spawned workers see the same registry.
    """

    def wrap(cls: T) -> T:
        from model_loader.base_loader import BaseModelLoader

        if not (isinstance(cls, type) and issubclass(cls, BaseModelLoader)):
            raise TypeError(f"{cls!r} must subclass BaseModelLoader to be registered as {load_format!r}")
        _USER_LOADERS[load_format] = cls
        return cls

    return wrap


def get_supported_load_formats() -> list[str]:
    return sorted({*_BUILTIN_LOADERS, *_USER_LOADERS})


def get_model_loader_cls(load_format: str) -> type["BaseModelLoader"]:
    if load_format in _USER_LOADERS:
        return _USER_LOADERS[load_format]
    target = _BUILTIN_LOADERS.get(load_format)
    if target is None:
        raise ValueError(f"load_format={load_format!r} is not valid; valid formats: {get_supported_load_formats()}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
