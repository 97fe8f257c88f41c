"""How a FusedMoE layer stores and applies its experts: the MoE layers' quantisation seam.

vLLM's shape (`FusedMoEMethodBase`), as the linear methods' (quantization/base.py):

1. `create_weights(layer, ...)` registers this rank's stacked expert tensors on the
   FusedMoE, in the checkpoint's layout, each with `layer.weight_loader` and tagged with
   `expert_suffix` (the checkpoint name's last part: "weight", "weight_scale_inv")
   and, for a scale tensor, `expert_block` = (block_n, block_k), the values one scale
   covers (1 by the whole input per channel): the loader then counts rows and columns
   in blocks when it takes an expert's slice. A checkpoint tensor stored the other way
   round (GPTQ's and AWQ's [in, out]), or a per-tensor scale held per channel, is
   tagged with `expert_transform` (a transpose, a widening), applied before the loader
   looks at it (a ValueError it raises becomes a WeightLoadError naming the tensor);
   several values packed into one element count as a block (eight int4 codes to an
   int32 along the inputs: (1, 8)).
2. `process_weights_after_loading(layer)` once every tensor is in place.
3. `apply(layer, x, topk_weights, topk_ids)` every forward: this rank's partial sum.

`FusedMoE` asks the model's quantisation config for a method (`get_moe_method`) while
the model is built (models/layers/build_config.py) and takes
`UnquantizedFusedMoEMethod` where it gives none. Called on every rank alike; a method
holds no tensors itself (they are the layer's registered parameters, so `state_dict()`,
sleep mode and memory accounting see them).
"""

from __future__ import annotations

import ctypes
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.layers.fused_moe import cpu_moe
from models.layers.fused_moe.grouped_moe import grouped_fused_experts


def expert_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, suffix: str,
                     block: tuple[int, int] | None = None,
                     transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Parameter:
    """Register a frozen, uninitialised stacked expert tensor `name` on `layer`, loaded
    by `layer.weight_loader` from the checkpoint tensors ending in `.<suffix>` (each
    passed through `transform` first, when given)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = layer.weight_loader
    param.expert_suffix = suffix
    param.expert_block = block
    param.expert_transform = transform
    layer.register_parameter(name, param)
    return param


#: Up to this many tokens (a decode step's batch) the quantised formats' experts run in one C
#: call (fp8_moe.c, kernels/wna16_moe.c, kernels/int8_moe.c, gguf_moe.c), which a CPU graph
#: records; a prefill's larger batches are grouped in torch.
MAX_KERNEL_TOKENS = 64


def one_call_applies(x: torch.Tensor, x_dtypes: Any, max_tokens: int = MAX_KERNEL_TOKENS) -> bool:
    """Whether a step of `x` [T, H] goes to a one-call experts kernel: CPU, 1 to
    `max_tokens` tokens, a dtype of `x_dtypes`, unit stride along H."""
    return x.device.type == "cpu" and 0 < x.shape[0] <= max_tokens and x.dtype in x_dtypes and x.stride(1) == 1


_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
#: The routing arguments every one-call experts kernel ends with (`one_call_experts`).
_ROUTING_ARGTYPES = (_P, _I32, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _P, _I32)


@functools.cache
def bind_one_call(lib: Any, name: str, weight_argtypes: tuple[Any, ...]) -> Any:
    """Library `lib`'s one-call experts entry point `name`, its types set once: int status,
    `weight_argtypes` (a format's weights, then H and I), then the shared routing tail."""
    entry = getattr(lib, name)
    entry.restype = _I32
    entry.argtypes = [*weight_argtypes, *_ROUTING_ARGTYPES]
    return entry


def one_call_experts(entry: Any, weight_args: list[Any], x: torch.Tensor, x_dtype_code: int,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                     num_experts: int, num_local: int, what: str) -> torch.Tensor | None:
    """A step's experts in one C call `entry(*weight_args, x, x_dtype_code, ldx, T,
    topk_ids, topk_weights, top_k, expert_map, num_experts, num_local, y, threads)`,
    the routing tail the one-call kernels share (fused_moe/expert_pairs.h): [T, H]
    float32, or None where the build lacks the kernel's products (status -2).
    ValueError (-1) for an expert id outside the model's or past this rank's; MemoryError
    (-3) without scratch. `what` names the experts in errors."""
    tokens, hidden = x.shape
    weights, ids = topk_weights.float().contiguous(), topk_ids.to(torch.int64).contiguous()
    y = torch.empty(tokens, hidden, dtype=torch.float32)
    status = entry(*weight_args, x.data_ptr(), x_dtype_code, x.stride(0), tokens, ids.data_ptr(),
                   weights.data_ptr(), ids.shape[1], None if expert_map is None else expert_map.data_ptr(),
                   num_experts, num_local, y.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise ValueError(f"{what}: an expert id outside the model's {num_experts} experts, or one the expert map "
                         f"sends past this rank's {num_local}")
    if status == -3:
        raise MemoryError(f"{what}: no memory for the pairs' scratch")
    if status == -2:
        return None
    if status:
        raise RuntimeError(f"{what}: the experts kernel returned {status}")
    return y


class FusedMoEMethodBase(ABC):
    """How one FusedMoE layer stores and applies its experts (see the module docstring)."""

    #: Whether `apply` can be captured in a CUDA graph (no host read of device values);
    #: worker/cuda_graph.py captures nothing for a model holding a layer that cannot.
    supports_cuda_graphs: bool = True
    #: Per-expert checkpoint tensors the method reads nothing from, dropped by the loader
    #: (fused_moe/expert_weights.py): GPTQ's g_idx without act-order, compressed-tensors'
    #: weight_shape.
    ignored_expert_suffixes: tuple[str, ...] = ()

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_per_rank: int, params_dtype: torch.dtype) -> None:
        """Register this rank's expert tensors on `layer` (from FusedMoE's constructor).
        Raises ValueError where this rank's slice cannot hold the checkpoint's layout."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Repack the loaded experts; called once, after the strict all-loaded check."""

    @abstractmethod
    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t) over this rank's
        experts ([T, H], x's dtype): this rank's partial sum, not all-reduced."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Full-precision experts in the model's dtype: `w13_weight` [E_local, 2I, H] (each
    expert's gate rows, then its up rows) and `w2_weight` [E_local, H, I]. The kernel:
    Triton on CUDA (`fused_moe_triton.py`), a bf16 or fp16 decode step's experts in one C
    call (`cpu_moe.py`), grouped GEMMs otherwise (`grouped_moe.py`)."""

    def create_weights(self, layer: nn.Module, num_local_experts: int, hidden_size: int,
                       intermediate_per_rank: int, params_dtype: torch.dtype) -> None:
        expert_parameter(layer, "w13_weight", (num_local_experts, 2 * intermediate_per_rank, hidden_size),
                         params_dtype, "weight")
        expert_parameter(layer, "w2_weight", (num_local_experts, hidden_size, intermediate_per_rank),
                         params_dtype, "weight")

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        if x.device.type == "cuda":
            from models.layers.fused_moe.fused_moe_triton import triton_fused_experts

            return triton_fused_experts(x, w13, w2, topk_weights, topk_ids, layer.expert_map)
        if (kernel := cpu_moe.serves(x, w13, w2)) is not None:
            return kernel.experts(x, w13, w2, topk_weights.float().contiguous(), topk_ids.to(torch.int64).contiguous(),
                                  layer.expert_map, layer.num_experts)
        return grouped_fused_experts(x, w13, w2, topk_weights, topk_ids, layer.expert_map)
