"""The engine: configuration, EngineCore, scheduling and serving.

`from engine import EngineCore, EngineConfig, SamplingParams` works; the names are
imported on first use, so worker processes that only unpickle engine messages do not
pull in the whole engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "engine.config",
    "EngineCore": "engine.core",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = list(_EXPORTS)
