"""DefaultModelLoader: local checkpoints in safetensors or PyTorch `.bin`/`.pt` form.

load_format -> files and iterator:
  "auto" / "hf"   safetensors when the directory has any, else `.bin` (pt_weights)
  "safetensors"   safetensors only (a `.bin`-only directory is an error)
  "pt"            `*.pt`, else `*.bin`, read with torch.load(weights_only=True, mmap=True)
  "npcache"       `*.bin`, converted once to a memory-mapped numpy cache (npcache.py)
With `model_loader_extra_config={"enable_multithread_load": True, "num_threads": N}`
safetensors and pt files are read by N parallel threads (multithread.py).
With `EngineConfig(check_weights_finite=True)` every floating-point tensor is scanned
for NaN and Inf, and each one that has any is logged as a warning naming the tensor and
its file (off by default: it reads every byte of the checkpoint once more).
A model with `is_local_checkpoint_tensor(name)` (the MoE architectures under expert
parallelism) never receives the names it rejects: the safetensors reader drops them
from the headers, so the default lazy reader never touches another rank's experts.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from distributed import get_tensor_model_parallel_rank
from model_loader.base_loader import BaseModelLoader
from model_loader.multithread import (
    multi_thread_pt_weights_iterator,
    multi_thread_safetensors_weights_iterator,
    parse_multithread_config,
)
from model_loader.pt_weights import pt_weights_iterator
from model_loader.safetensors_reader import safetensors_weights_iterator
from model_loader.weight_files import prepare_weight_files
from models.errors import WeightLoadError
from models.layers.weight_utils import alias_checkpoint_tensors
from models.utils import format_names

if TYPE_CHECKING:
    from config import LoadConfig, ModelConfig

logger = logging.getLogger(__name__)
# Elements scanned per step by the finite check: bounds its temporary masks to a few MiB.
_FINITE_CHECK_CHUNK = 1 << 22


class DefaultModelLoader(BaseModelLoader):
    """Streams (name, tensor) pairs from the model directory into `model.load_weights`.

    Memory: see `safetensors_reader` — parameters plus about one tensor on the default
    "lazy" strategy; `.bin` files are memory-mapped one at a time (pt_weights). Raises
    `WeightLoadError` when files are missing or unreadable, when a `.weight`/`.bias`
    tensor is not floating point (see `check_float_weights`), and when after the stream
    any parameter is still unloaded (all of them named). An unknown
    `model_loader_extra_config` key is a ValueError listing the valid ones.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.multithread, self.num_threads = parse_multithread_config(
            load_config.model_loader_extra_config, load_config.load_format
        )

    def _weights_iterator(
        self, model_config: ModelConfig, name_filter: Callable[[str], bool] | None = None
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], bool]:
        """The (name, tensor) stream, and whether its tensors are views of read-only file
        mappings that parameters may alias (the lazy and prefetch safetensors reader).
        Names `name_filter` rejects are left out (see the module docstring)."""
        model_dir = Path(model_config.model)
        load_format = self.load_config.load_format
        files, use_safetensors = prepare_weight_files(model_dir, load_format, self.load_config.ignore_patterns)
        use_tqdm = self.load_config.use_tqdm_on_load and get_tensor_model_parallel_rank() == 0
        if load_format == "npcache":
            from model_loader.npcache import np_cache_weights_iterator

            weights = np_cache_weights_iterator(model_dir, self.load_config.download_dir, files)
        elif use_safetensors:
            if self.multithread:
                weights = multi_thread_safetensors_weights_iterator(files, self.num_threads, use_tqdm)
            else:
                weights = safetensors_weights_iterator(
                    files,
                    strategy=self.load_config.safetensors_load_strategy,
                    prefetch_num_threads=self.load_config.safetensors_prefetch_num_threads,
                    prefetch_block_size=self.load_config.safetensors_prefetch_block_size,
                    use_tqdm=use_tqdm,
                    name_filter=name_filter,
                )
        elif self.multithread:
            weights = multi_thread_pt_weights_iterator(files, self.num_threads, use_tqdm)
        else:
            weights = pt_weights_iterator(files, use_tqdm)
        file_mapped = (
            use_safetensors
            and load_format != "npcache"
            and not self.multithread
            and self.load_config.safetensors_load_strategy != "eager"
        )
        if name_filter is not None:
            # The other readers load or map whole files; a rejected name still reaches no layer.
            weights = ((name, tensor) for name, tensor in weights if name_filter(name))
        weights = check_float_weights(weights, model_dir, allow_int8=model_config.quantization is not None)
        if self.load_config.check_weights_finite:
            weights = warn_non_finite_weights(weights, files, use_safetensors and load_format != "npcache")
        return weights, file_mapped

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Whole, unsliced weights become views of the mapped file rather than copies
        (`alias_checkpoint_tensors`): no second copy, no anonymous memory, and on CPU at
        TP=1 about half the bytes of a Llama are never copied at all."""
        weights, file_mapped = self._weights_iterator(model_config, getattr(model, "is_local_checkpoint_tensor", None))
        with alias_checkpoint_tensors() if file_mapped else contextlib.nullcontext():
            loaded = model.load_weights(weights)
        check_all_weights_loaded(model, loaded, model_config.model)


def check_float_weights(
    weights: Iterator[tuple[str, torch.Tensor]], source: Path | str, allow_int8: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Refuse a `.weight` / `.bias` tensor that is not floating point (int8 allowed for a
    quantised checkpoint, `allow_int8`: W8A8's weights are int8 `.weight` tensors).

    Parameters are floating point (float32/16, bfloat16, or float8 for fp8 checkpoints),
    and `copy_` would silently cast an integer or bool tensor into them, turning a
    corrupt or foreign checkpoint into garbage logits. Other names (integer buffers such
    as `position_ids`, which models skip) pass through untouched.
    """
    for name, tensor in weights:
        if (name.endswith((".weight", ".bias")) and not tensor.is_floating_point()
                and not (allow_int8 and tensor.dtype == torch.int8)):
            raise WeightLoadError(
                f"checkpoint tensor {name!r} in {source} has dtype {tensor.dtype}, but weights must be floating "
                "point: the checkpoint is corrupt or not for this model"
            )
        yield name, tensor


def count_non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    """(NaN count, Inf count) of a floating-point tensor, scanned in chunks so that the
    temporary masks stay small whatever the tensor's size. float8 values are widened
    chunk by chunk (torch has no isnan for them on every device)."""
    flat = tensor.detach().reshape(-1)
    nan = inf = 0
    for start in range(0, flat.numel(), _FINITE_CHECK_CHUNK):
        chunk = flat[start:start + _FINITE_CHECK_CHUNK]
        if chunk.element_size() == 1:
            chunk = chunk.float()
        if bool(torch.isfinite(chunk).all()):
            continue
        nan += int(torch.isnan(chunk).sum())
        inf += int(torch.isinf(chunk).sum())
    return nan, inf


def warn_non_finite_weights(
    weights: Iterator[tuple[str, torch.Tensor]], files: list[Path], safetensors: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass `weights` through; log one warning for every floating-point tensor that holds
    NaN or Inf, naming it, its file (among `files`) and the counts. A warning, not an
    error: some checkpoints carry such values on purpose (masks, unused rows); garbage
    logits from a corrupt download are what this is for."""
    for name, tensor in weights:
        if tensor.is_floating_point() and tensor.numel():
            nan, inf = count_non_finite(tensor)
            if nan or inf:
                logger.warning(
                    "checkpoint tensor %r in %s has %d NaN and %d Inf value(s) out of %d: the checkpoint is "
                    "probably corrupt, and outputs that use it will be garbage",
                    name, _file_holding(name, files, safetensors), nan, inf, tensor.numel(),
                )
        yield name, tensor


def _file_holding(name: str, files: list[Path], safetensors: bool) -> str:
    """The file among `files` that holds tensor `name` (found only on this rare path:
    headers for safetensors, a memory-mapped load for `.bin`)."""
    if len(files) == 1:
        return str(files[0])
    from model_loader.pt_weights import load_pt_file
    from model_loader.safetensors_reader import read_safetensors_header

    for path in files:
        try:
            names = ([e.name for e in read_safetensors_header(path)[0]] if safetensors
                     else list(load_pt_file(path)))
        except WeightLoadError:
            continue
        if name in names:
            return str(path)
    return f"one of {[str(f) for f in files]}"


def check_all_weights_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    """The strict check shared by loaders: every parameter must have been filled."""
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise WeightLoadError(
            f"{len(missing)} parameter(s) of {type(model).__name__} were not loaded from {source}: "
            f"{format_names(missing)}"
        )
