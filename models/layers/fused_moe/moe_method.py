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
    Triton on CUDA (`fused_moe_triton.py`), a bf16 decode step's experts in one C call
    (`cpu_moe.py`), grouped GEMMs otherwise (`grouped_moe.py`)."""

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
