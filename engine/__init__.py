"""The engine: EngineCore, scheduling and serving.

`from engine import EngineCore, EngineConfig, SamplingParams` works (the config types
live in `config/`, the lowest package); the names are imported on first use, so that
importing `engine` costs nothing until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "config",
    "EngineCore": "engine.core",
    "SamplingParams": "config",
    "RequestOutputKind": "config",
    "RequestOutput": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = list(_EXPORTS)
