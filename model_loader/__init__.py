"""Model loading: pick a loader by `load_format`, build the architecture, stream in weights.

`get_model(config)` is the entry point; it runs in each worker for that worker's rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from model_loader.base_loader import BaseModelLoader
from model_loader.registry import get_model_loader_cls, get_supported_load_formats, register_model_loader
from models.errors import UnsupportedArchitectureError, WeightLoadError

if TYPE_CHECKING:
    from config import EngineConfig, LoadConfig


def get_model_loader(load_config: LoadConfig) -> BaseModelLoader:
    """The loader instance for `load_config.load_format`; ValueError lists the valid formats."""
    return get_model_loader_cls(load_config.load_format)(load_config)


def get_model(config: EngineConfig) -> nn.Module:
    """Build and load the model for the calling process's TP rank (no process group needed at TP=1)."""
    return get_model_loader(config.load_config).load_model(config)


__all__ = [
    "BaseModelLoader",
    "UnsupportedArchitectureError",
    "WeightLoadError",
    "get_model",
    "get_model_loader",
    "get_supported_load_formats",
    "register_model_loader",
]
