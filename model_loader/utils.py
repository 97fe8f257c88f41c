"""Stages shared by every loader: build the module, post-process it after loading."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from models.layers.quantization import set_current_quant_config
from models.registry import ModelRegistry


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get `dtype`; the previous default comes back after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model_architecture(config: Any) -> tuple[type[nn.Module], str]:
    """The model class for config.json's `architectures`; raises UnsupportedArchitectureError."""
    return ModelRegistry.resolve_model_cls(config.model_config.architectures)


def initialize_model(config: Any, prefix: str = "") -> nn.Module:
    """Construct the architecture on the current default device and dtype. Parameters are
    allocated but uninitialised: a loader must fill every one of them."""
    model_cls, _ = get_model_architecture(config)
    # Linear layers built inside pick their quant_method from the current config.
    with set_current_quant_config(getattr(config, "quant_config", None)):
        return model_cls(config, prefix=prefix)


def process_weights_after_loading(model: nn.Module, config: Any, target_device: torch.device) -> None:
    """Give every module its chance to repack weights once all of them are in place
    (quantisation, derived buffers), then, on the CPU, pack float32 linear weights for
    small batches (models/layers/cpu_gemm.py). Runs after the strict all-loaded check."""
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook) and module is not model:
            hook()
    device_config = getattr(config, "device_config", None)
    if target_device.type == "cpu" and getattr(device_config, "cpu_prepack_weights", False):
        from models.layers.cpu_gemm import prepack_cpu_weights

        prepack_cpu_weights(model)


def get_load_device(config: Any) -> torch.device:
    """Where parameters are created: this rank's CUDA device, or the CPU."""
    if config.device_config.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
