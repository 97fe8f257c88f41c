"""BaseModelLoader: the fixed order of a load, with one step left to subclasses."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from model_loader.huge_pages import place_in_huge_pages
from model_loader.utils import (
    get_load_device,
    initialize_model,
    process_weights_after_loading,
    set_default_torch_dtype,
)
from models.layers.file_pages import trim_heap

if TYPE_CHECKING:
    from config import EngineConfig, LoadConfig, ModelConfig


class BaseModelLoader(ABC):
    """A template method. `load_model()` always runs, in this order:
    load device -> default dtype -> initialize_model() -> (CPU) huge pages -> load_weights() ->
    process_weights_after_loading() -> eval().

    Subclasses implement `load_weights()`: fill every parameter of the model on this
    rank from local files (the engine has already resolved a Hub id to a directory), or
    raise `WeightLoadError`. One instance per process and load; it is built from the
    validated `LoadConfig` and may reject its `model_loader_extra_config` there.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    @abstractmethod
    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Fill every parameter of `model` with this rank's slice."""

    def load_model(self, config: EngineConfig) -> nn.Module:
        """Build and load the model for the calling process's TP rank. At TP=1 no
        process group is needed. On the CPU the large weights are loaded into one mapping
        (model_loader/huge_pages.py): the pages of those a loader or a module's
        post-processing replaced are handed back as each module is done, the rest made
        huge in the background once the load is done."""
        device = get_load_device(config)
        with set_default_torch_dtype(config.model_config.dtype), device:
            model = initialize_model(config)
        arena = place_in_huge_pages(model) if device.type == "cpu" else None
        with torch.no_grad():
            self.load_weights(model, config.model_config)
            process_weights_after_loading(model, arena.release_unused if arena is not None else None)
        if arena is not None:
            trim_heap()
            arena.collapse_in_background()
        return model.eval()
