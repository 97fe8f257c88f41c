"""BaseModelLoader: the fixed order of a load, with two steps left to subclasses."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from model_loader.utils import (
    get_load_device,
    initialize_model,
    process_weights_after_loading,
    set_default_torch_dtype,
)


class BaseModelLoader(ABC):
    """A template method. `load_model()` always runs, in this order:
    load device -> default dtype -> initialize_model() -> load_weights() ->
    process_weights_after_loading() -> eval().

    Subclasses implement `download_model()` (make the files local; called once by the
    engine before workers start) and `load_weights()` (fill every parameter of the model
    on this rank, or raise `WeightLoadError`).
    """

    def __init__(self, load_config: Any) -> None:
        self.load_config = load_config

    @abstractmethod
    def download_model(self, model_config: Any) -> None:
        """Fetch whatever the load needs so that `load_weights` reads local files only."""

    @abstractmethod
    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        """Fill every parameter of `model` with this rank's slice."""

    def load_model(self, config: Any) -> nn.Module:
        """Build and load the model for the calling process's TP rank. At TP=1 no
        process group is needed."""
        device = get_load_device(config)
        with set_default_torch_dtype(config.model_config.dtype), device:
            model = initialize_model(config)
        with torch.no_grad():
            self.load_weights(model, config.model_config)
            process_weights_after_loading(model, config, device)
        return model.eval()
