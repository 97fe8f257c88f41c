"""Tensor-parallel linear layers.

Column-parallel layers split the output features across ranks and need no
communication; row-parallel layers split the input features and all-reduce their
partial sums. Each layer's `weight_loader` knows its own slice, so the loader that
walks checkpoint names stays trivial (the nano-vllm idea).

Parameters are created with `torch.empty` on the default device and dtype that the
model loader has set: nothing is initialised, because every value is overwritten by
the checkpoint (or by the dummy loader).
"""

from __future__ import annotations

import torch
from torch import nn

from models.errors import WeightLoadError
from models.layers.quantization import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
    get_current_quant_config,
)
from models.layers.weight_utils import copy_checked, load_whole, narrow_for_rank, set_weight_attrs
from worker.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def _check_full_dim(loaded: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise WeightLoadError(
            f"shape mismatch ({what}): the model expects size {expected} along dim {dim}, "
            f"the checkpoint tensor has shape {tuple(loaded.shape)}"
        )


class LinearBase(nn.Module):
    """Holds `weight` [out_per_rank, in_per_rank] and an optional `bias`.

    `quant_method` computes the product: `UnquantizedLinearMethod` (plain F.linear)
    unless a quantisation config is given, or is current while the model is built
    (`models.layers.quantization.set_current_quant_config`). After loading,
    `quant_method.process_weights_after_loading(self)` may replace `weight`.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool, quant_config: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        if quant_config is None:
            quant_config = get_current_quant_config()
        method = quant_config.get_linear_method(self) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method if method is not None else UnquantizedLinearMethod()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        load_whole(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = xA^T + b with A split along its output dim: rank r holds rows [r*n, (r+1)*n)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.total_output_size = output_size
        super().__init__(input_size, _divide(output_size, tp_size, "output_size"), bias, quant_config)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _check_full_dim(loaded_weight, 0, self.total_output_size, "column-parallel output dim")
        shard = narrow_for_rank(loaded_weight, 0, param.shape[0], self.tp_rank, "column-parallel")
        load_whole(param, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return tensor_model_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (e.g. gate_up_proj).

    Each rank's weight is the concatenation of its slice of every sub-projection, so the
    output splits cleanly into per-projection halves with no communication.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, quant_config=quant_config)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise WeightLoadError(
                "a fused checkpoint tensor was given to a merged column-parallel layer; "
                "checkpoints must hold the sub-projections separately"
            )
        total = self.output_sizes[shard_id]
        _check_full_dim(loaded_weight, 0, total, f"merged projection {shard_id}")
        shard_size = total // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = narrow_for_rank(loaded_weight, 0, shard_size, self.tp_rank, f"merged projection {shard_id}")
        copy_checked(param.data.narrow(0, offset, shard_size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection.

    Query heads are split across ranks. When tp_size exceeds the number of KV heads,
    each KV head is replicated on tp_size // num_kv_heads consecutive ranks (one KV head
    per rank), which is what keeps TP > num_kv_heads working.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp_size}) exceeds num_key_value_heads ({total_num_kv_heads}) "
                    "but is not a multiple of it, so KV heads cannot be replicated evenly"
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        output_per_rank = (self.num_heads + 2 * self.num_kv_heads) * head_size
        # The base class divides by tp_size, so hand it the "total" that gives our per-rank width.
        super().__init__(hidden_size, output_per_rank * tp_size, bias, quant_config=quant_config)
        self.total_output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise WeightLoadError("qkv_proj needs separate q/k/v checkpoint tensors (shard_id 'q', 'k' or 'v')")
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, shard_rank, total_heads = 0, q_size, self.tp_rank, self.total_num_heads
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, shard_rank, total_heads = kv_size, self.tp_rank // self.num_kv_head_replicas, self.total_num_kv_heads
        _check_full_dim(loaded_weight, 0, total_heads * self.head_size, f"{shard_id}_proj")
        shard = narrow_for_rank(loaded_weight, 0, size, shard_rank, f"{shard_id}_proj")
        copy_checked(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """y = xA^T + b with A split along its input dim; partial sums are all-reduced.

    The bias is added once, after the all-reduce, so it is not counted tp_size times.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.total_input_size = input_size
        super().__init__(_divide(input_size, tp_size, "input_size"), output_size, bias, quant_config)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: replicated
            load_whole(param, loaded_weight)
            return
        _check_full_dim(loaded_weight, 1, self.total_input_size, "row-parallel input dim")
        shard = narrow_for_rank(loaded_weight, 1, param.shape[1], self.tp_rank, "row-parallel")
        load_whole(param, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)  # the bias is added once, after the reduce
        if self.reduce_results and self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
