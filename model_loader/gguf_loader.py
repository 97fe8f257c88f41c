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

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from model_loader.base_loader import BaseModelLoader
from model_loader.default_loader import check_all_weights_loaded
from model_loader.gguf_utils import find_gguf_file, gguf_weights_iterator, open_gguf
from models.layers.file_pages import release_file_pages_outside
from models.layers.weight_utils import alias_checkpoint_tensors

if TYPE_CHECKING:
    from config import ModelConfig


class GGUFModelLoader(BaseModelLoader):
    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """A tensor a parameter takes whole in its dtype (at TP=1 an F16 file's o_proj,
        down_proj, embedding and LM head loaded as float16, a quantised file's embedding
        and LM head blocks; not a fused layer's shard or a rank's slice) becomes a view of
        the file's copy-on-write mapping, or of the un-permuted copy the iterator made,
        rather than a copy (`alias_checkpoint_tensors`, as the safetensors loader does):
        45% of an F16 Llama's bytes never copied, held as page-cache pages rather than
        anonymous memory. The mapping then outlives the load, so the pages the copies
        read are handed back (`release_file_pages_outside`) as the load goes, every
        `RELEASE_EVERY_BYTES` of tensors read, not once at its end: the load's peak
        holds the copies and at most that much of the file they were read from, not all
        of it (an F16 853M Llama: 2.0-2.1 -> 1.3 GiB). Called on every rank."""
        path = find_gguf_file(model_config.model)
        reader = open_gguf(path)
        mapping = torch.from_numpy(reader.data)

        def release() -> None:
            release_file_pages_outside(mapping, itertools.chain(model.parameters(), model.buffers()))

        with alias_checkpoint_tensors():
            loaded = model.load_weights(_releasing(gguf_weights_iterator(reader, model_config.hf_config), release))
        check_all_weights_loaded(model, loaded, str(path))
        release()


#: Bytes of tensors read between two hand-backs of the file's pages during a GGUF load:
#: each hand-back walks the parameters (about 1 ms for a 16-layer model), and the pages
#: read in since the last are what the load's peak holds beyond the weights.
RELEASE_EVERY_BYTES = 128 << 20


def _releasing(weights: Iterator[tuple[str, torch.Tensor]], release: Callable[[], object]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, calling `release` once every RELEASE_EVERY_BYTES of them have been
    consumed (the model's weight loaders have copied or kept each before asking for
    the next). A tensor still held unconsumed (a model buffering several) loses only
    its pages, which are read back from the file: the mapping's pages are never
    written before they are released."""
    pending = 0
    for name, tensor in weights:
        yield name, tensor
        pending += tensor.numel() * tensor.element_size()
        if pending >= RELEASE_EVERY_BYTES:
            release()
            pending = 0
