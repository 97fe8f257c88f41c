"""FusedMoE: a mixture-of-experts block's experts as two stacked parameters.

Built by the MoE architectures (models/mixtral.py, models/qwen3_moe.py) on every rank,
inside the model loader's build; the router (`gate`, a replicated linear layer) stays in
the model, which passes its logits to `forward`.

Parameters (vLLM's names), registered by the layer's `quant_method`
(`moe_method.py`: the model's quantisation config's `get_moe_method`, else full
precision): `w13_weight` [num_local_experts, 2*intermediate_per_rank, hidden] holds
each expert's gate rows (w1) then its up rows (w3); `w2_weight` [num_local_experts,
hidden, intermediate_per_rank] its down projection; a quantised method registers its
own tensors in the same stacked layout (fp8: these in fp8 with `w13_weight_scale_inv`
and `w2_weight_scale_inv`, or `..._weight_scale`, counted in blocks or per output row;
int4/int8 weight-only: the checkpoint's codes, scales and zero points, repacked after
loading, quantization/wna16_moe.py; W8A8 int8: these in int8 with `..._weight_scale`
per output row, quantization/int8_moe.py; GGUF: the file's blocks,
quantization/gguf_moe.py).
  - tensor parallelism (default): every rank holds every expert, its intermediate
    dimension sliced like a column-parallel w1/w3 and a row-parallel w2;
  - expert parallelism (`enable_expert_parallel`, EP size = TP size): rank r holds
    whole experts [r*E/ep, (r+1)*E/ep) (`expert_map.ExpertPlacement`).
Either way each rank's output is a partial sum over the ranks: one all-reduce follows
(here with `reduce_results=True`, else in the next norm, as the dense MLPs do).

The kernel is the method's (`apply`): for full-precision experts, on the CPU a decode
step's experts in one C call for bfloat16 and float16 (`cpu_moe.py`: recordable as a
CPU graph), grouped torch GEMMs otherwise (`grouped_moe.py`), the Triton fused-MoE
kernel on CUDA (`fused_moe_triton.py`). Memory: the rank's experts as the method holds them, nothing
cached.
"""

from __future__ import annotations

import torch
from torch import nn

from distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from models.errors import WeightLoadError
from models.layers.build_config import get_layer_build_config
from models.layers.fused_moe.expert_map import determine_expert_placement
from models.layers.fused_moe.moe_method import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from models.layers.fused_moe.router import fused_topk
from models.layers.weight_utils import copy_checked, narrow_for_rank

EXPERT_SHARD_IDS = ("w1", "w2", "w3")  # gate, down, up: the names of Mixtral's checkpoint


class FusedMoE(nn.Module):
    """`forward(hidden_states [T, H], router_logits [T, E]) -> [T, H]`: every rank calls
    it alike with the same logits. Raises `ExpertParallelConfigError` at construction
    when expert parallelism cannot split E over the ranks."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        enable_expert_parallel: bool = False,
        reduce_results: bool = False,
        checkpoint_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        # The checkpoint's names of an expert's gate, up and down projections (Mixtral's w1,
        # w3, w2): a quantisation config that picks the experts' layout by module name
        # (compressed-tensors' targets and ignore) asks with them.
        self.checkpoint_proj_names = checkpoint_proj_names
        self.placement = determine_expert_placement(num_experts, enable_expert_parallel)
        self.top_k = top_k
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # Under EP the experts are whole; otherwise TP slices each expert's intermediate dim.
        self.intermediate_size = intermediate_size
        self.slice_intermediate = self.placement.ep_size == 1 and self.tp_size > 1
        self.intermediate_per_rank = (
            divide(intermediate_size, self.tp_size, "moe intermediate_size") if self.slice_intermediate
            else intermediate_size
        )
        self.hidden_size = hidden_size
        self.expert_map: torch.Tensor | None
        if self.placement.ep_size > 1:
            self.register_buffer("expert_map", self.placement.expert_map(), persistent=False)
        else:
            self.expert_map = None
        quant_config = get_layer_build_config().quant_config
        method = quant_config.get_moe_method(self) if quant_config is not None else None
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, self.placement.num_local_experts, hidden_size,
                                         self.intermediate_per_rank, torch.get_default_dtype())
        # (local expert, shard id, checkpoint suffix) filled so far: the strict check names the rest.
        self._loaded_shards: set[tuple[int, str, str]] = set()

    def set_quant_method(self, method: FusedMoEMethodBase) -> None:
        """Replace the method and its (not yet loaded) expert tensors: what the model
        loader does once the layer's name is known, for a config whose experts' layout
        differs per layer (GGUF: `QuantizationConfig.selects_moe_by_name`). Only before
        loading."""
        for name in [n for n, p in self.named_parameters(recurse=False) if hasattr(p, "expert_suffix")]:
            delattr(self, name)
        self.quant_method = method
        method.create_weights(self, self.placement.num_local_experts, self.hidden_size, self.intermediate_per_rank,
                              torch.get_default_dtype())
        self._loaded_shards.clear()

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    def expert_suffixes(self) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """Checkpoint suffix ("weight", "weight_scale_inv", ...) -> (the stacked parameter
        w1/w3 load into, the one w2 loads into), as the method registered them."""
        pairs: dict[str, dict[str, nn.Parameter]] = {}
        for name, param in self.named_parameters(recurse=False):
            suffix = getattr(param, "expert_suffix", None)
            if suffix is not None:
                pairs.setdefault(suffix, {})["w2" if name.startswith("w2") else "w13"] = param
        return {suffix: (pair["w13"], pair["w2"]) for suffix, pair in pairs.items()}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str, expert_id: int) -> None:
        """Load one expert's w1 / w3 ([I, H], into its half of w13) or w2 ([H, I]) from
        the full checkpoint tensor `weight_name`, narrowed to this rank's slice; a scale
        tensor (`param.expert_block` = (bn, bk), the values one scale covers) is
        [ceil(I/bn), ceil(H/bk)] or [ceil(H/bn), ceil(I/bk)] and is sliced in blocks (a
        per-channel scale, (1, the whole input), is w2's whole on every rank; packed
        codes count as blocks of the values one element holds). A tensor stored [in, out]
        is first turned by the parameter's `expert_transform`. A tensor of another
        rank's expert is ignored (the loader normally never reads it)."""
        if shard_id not in EXPERT_SHARD_IDS:
            raise WeightLoadError(f"{weight_name!r}: expert shard id {shard_id!r} is not one of {EXPERT_SHARD_IDS}")
        local = self.placement.local_expert_id(expert_id)
        if local is None:
            return
        if (transform := getattr(param, "expert_transform", None)) is not None:
            try:  # [in, out] tensors turned, per-tensor scales widened: see moe_method.py
                loaded_weight = transform(loaded_weight)
            except ValueError as e:
                raise WeightLoadError(f"{weight_name!r}: expert {expert_id} {shard_id}: {e}") from None
        block_n, block_k = getattr(param, "expert_block", None) or (1, 1)
        rank = self.tp_rank if self.slice_intermediate else 0
        if shard_id == "w2":
            expected = (-(-self.hidden_size // block_n), -(-self.intermediate_size // block_k))
            size, dim = param.shape[2], 1
            dst = param.data[local]
        else:
            expected = (-(-self.intermediate_size // block_n), -(-self.hidden_size // block_k))
            size, dim = param.shape[1] // 2, 0
            dst = param.data[local].narrow(0, 0 if shard_id == "w1" else size, size)
        # (a tensor held in blocks of bytes has their trailing dims: [rows, blocks, bytes])
        expected += tuple(param.shape[3:])
        if tuple(loaded_weight.shape) != expected:
            raise WeightLoadError(
                f"{weight_name!r}: expert {expert_id} {shard_id} has shape {tuple(loaded_weight.shape)}, "
                f"the model expects {expected}"
            )
        if loaded_weight.shape[dim] == size:  # whole along the sliced dim (a per-channel scale's one column)
            rank = 0
        shard = narrow_for_rank(loaded_weight, dim, size, rank, f"expert {shard_id}")
        copy_checked(dst, shard, f"{weight_name} -> expert {expert_id} {shard_id}")
        self._loaded_shards.add((local, shard_id, getattr(param, "expert_suffix", "weight")))

    def missing_expert_shards(self) -> list[tuple[int, str, str]]:
        """(global expert id, shard id, checkpoint suffix) of every local expert tensor not
        loaded yet."""
        first = self.placement.first_local_expert
        suffixes = list(self.expert_suffixes())
        return [(first + local, shard, suffix) for local in range(self.placement.num_local_experts)
                for suffix in suffixes for shard in EXPERT_SHARD_IDS
                if (local, shard, suffix) not in self._loaded_shards]

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the experts' weighted outputs ([T, H]), all-reduced
        when `reduce_results`. A collective then: every rank calls it alike."""
        topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)
        out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
