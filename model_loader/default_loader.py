"""DefaultModelLoader: local safetensors checkpoints (load_format auto / hf / safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from model_loader.base_loader import BaseModelLoader
from model_loader.safetensors_reader import safetensors_weights_iterator
from model_loader.weight_files import prepare_weight_files
from models.errors import WeightLoadError
from models.utils import format_names
from worker.parallel_state import get_tensor_model_parallel_rank


class DefaultModelLoader(BaseModelLoader):
    """Streams (name, tensor) pairs from the model directory into `model.load_weights`.

    Memory: see `safetensors_reader` — parameters plus about one tensor on the default
    "lazy" strategy. Raises `WeightLoadError` when files are missing or unreadable, and
    when after the stream any parameter is still unloaded (all of them named).
    """

    def download_model(self, model_config: Any) -> None:
        model_dir = Path(model_config.model)
        prepare_weight_files(model_dir, self.load_config.load_format, self.load_config.ignore_patterns)

    def get_all_weights(self, model_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        model_dir = Path(model_config.model)
        files, use_safetensors = prepare_weight_files(
            model_dir, self.load_config.load_format, self.load_config.ignore_patterns
        )
        if not use_safetensors:
            raise WeightLoadError(
                f"{model_dir} holds only .bin/.pt weights; load_format={self.load_config.load_format!r} "
                "reads safetensors files"
            )
        return safetensors_weights_iterator(
            files,
            strategy=self.load_config.safetensors_load_strategy,
            prefetch_num_threads=self.load_config.safetensors_prefetch_num_threads,
            prefetch_block_size=self.load_config.safetensors_prefetch_block_size,
            use_tqdm=self.load_config.use_tqdm_on_load and get_tensor_model_parallel_rank() == 0,
        )

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        loaded = model.load_weights(self.get_all_weights(model_config))
        check_all_weights_loaded(model, loaded, model_config.model)


def check_all_weights_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    """The strict check shared by loaders: every parameter must have been filled."""
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise WeightLoadError(
            f"{len(missing)} parameter(s) of {type(model).__name__} were not loaded from {source}: "
            f"{format_names(missing)}"
        )
