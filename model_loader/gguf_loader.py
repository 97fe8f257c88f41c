"""GGUFModelLoader: llama.cpp GGUF files (load_format "gguf").

`model` is a .gguf file or a directory holding exactly one. The architecture and sizes
come from the GGUF metadata (the engine's resolution step builds `hf_config` with
`model_loader.gguf_utils.gguf_hf_config`, with the `quantization_config` that keeps
Q4_0/Q8_0/Q4_K/Q5_K/Q6_K tensors in their blocks: models/layers/quantization/gguf.py);
tensors are renamed to their HF names (`.qweight` for those held as blocks),
un-permuted (llama q/k rows), dequantised only where no kernel reads their type, then
fed through the model's normal `load_weights`, so each rank keeps only its TP slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from model_loader.base_loader import BaseModelLoader
from model_loader.default_loader import check_all_weights_loaded
from model_loader.gguf_utils import find_gguf_file, gguf_weights_iterator

if TYPE_CHECKING:
    from config import ModelConfig


class GGUFModelLoader(BaseModelLoader):
    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        path = find_gguf_file(model_config.model)
        loaded = model.load_weights(gguf_weights_iterator(path, model_config.hf_config))
        check_all_weights_loaded(model, loaded, str(path))
