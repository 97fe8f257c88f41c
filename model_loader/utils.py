"""Stages shared by every loader: build the module, post-process it after loading."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from models.layers.build_config import LayerBuildConfig, set_layer_build_config
from models.layers.cpu_gemm import default_packed_gemm, reusing_upcast_buffer
from models.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod
from models.layers.linear import LinearBase
from models.layers.quantization import get_quantization_config
from models.layers.unquantized import tracking_shared_weights
from models.registry import ModelRegistry

if TYPE_CHECKING:
    from config import EngineConfig


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get `dtype`; the previous default comes back after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def get_model_architecture(config: EngineConfig) -> tuple[type[nn.Module], str]:
    """The model class for config.json's `architectures`; raises UnsupportedArchitectureError."""
    return ModelRegistry.resolve_model_cls(config.model_config.architectures)


def initialize_model(config: EngineConfig, prefix: str = "") -> nn.Module:
    """Construct the architecture on the current default device and dtype. Parameters are
    allocated but uninitialised: a loader must fill every one of them. The layers pick
    their linear methods (quantisation, platform) from the LayerBuildConfig set here."""
    model_cls, _ = get_model_architecture(config)
    build_config = LayerBuildConfig(
        quant_config=get_quantization_config(config.model_config.quantization,
                                             getattr(config.model_config.hf_config, "quantization_config", None)),
        device_type=config.device_config.device_type,
        cpu_prepack_weights=config.device_config.cpu_prepack_weights,
        cpu_packed_gemm=default_packed_gemm(),
    )
    with set_layer_build_config(build_config):
        model = model_cls(config, prefix=prefix)
        if build_config.quant_config is not None:
            _select_linear_methods_by_name(model, build_config)
        return model


def _select_linear_methods_by_name(model: nn.Module, build_config: LayerBuildConfig) -> None:
    """Ask the quantisation config again for every linear layer, now with its module
    name (layers are built without one): a checkpoint may leave layers unquantised by
    name (compressed-tensors' `ignore`, GPTQ's `modules_to_not_convert`) or quantise
    them differently (compressed-tensors' config groups). A layer built with
    `skip_quantization` (a MoE router) is not asked. A FusedMoE is asked again only where
    the config `selects_moe_by_name` (GGUF's per-layer expert types, compressed-tensors'
    targets and ignore). A layer whose answer is not its current method gets the new one
    and new, empty parameters (None: the platform's unquantised method, or full-precision
    experts); nothing is loaded yet, so nothing is lost."""
    quant_config = build_config.quant_config
    packed = getattr(model, "packed_modules_mapping", {})
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and not module.skip_quantization:
            method = quant_config.get_linear_method(module, name, packed)
            if method is not module.quant_method:
                module.set_quant_method(method or build_config.unquantized_linear_method())
        elif isinstance(module, FusedMoE) and quant_config.selects_moe_by_name:
            moe_method = quant_config.get_moe_method(module, name)
            if moe_method is None and isinstance(module.quant_method, UnquantizedFusedMoEMethod):
                continue  # full precision, as built
            if moe_method is not module.quant_method:
                module.set_quant_method(moe_method or UnquantizedFusedMoEMethod())


def process_weights_after_loading(model: nn.Module, after_each: Callable[[], object] | None = None) -> None:
    """Give every module's method, then every module, its chance to repack weights once
    all of them are in place (quantisation, CPU packing, derived buffers). Runs after
    the strict all-loaded check, on every rank, and again after `update_weights`
    (methods skip what they processed already). A weight several modules share (a tied
    LM head's) is replaced in all of them when the CPU packs it. `after_each` runs after
    each module's turn: the load hands back the memory of the weights a module replaced
    there (model_loader/huge_pages.py), so a load's peak holds one layer twice, not all."""
    with reusing_upcast_buffer(), tracking_shared_weights(model):
        for module in model.modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
            hook = getattr(module, "process_weights_after_loading", None)
            if callable(hook) and module is not model:
                hook()
            if after_each is not None:
                after_each()


def get_load_device(config: EngineConfig) -> torch.device:
    """Where parameters are created: this rank's CUDA device, or the CPU."""
    if config.device_config.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
