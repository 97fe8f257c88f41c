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

from distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    kv_heads_per_rank,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from models.errors import WeightLoadError
from models.layers.build_config import get_layer_build_config
from models.layers.quantization import LinearMethodBase, QuantizationConfig
from models.layers.weight_utils import copy_checked, load_whole, narrow_for_rank, set_weight_attrs


def _check_full_dim(loaded: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise WeightLoadError(
            f"shape mismatch ({what}): the model expects size {expected} along dim {dim}, "
            f"the checkpoint tensor has shape {tuple(loaded.shape)}"
        )


class LinearBase(nn.Module):
    """Holds this rank's shard of a linear layer's weights and an optional `bias`.

    `quant_method` owns the weights' layout: the given quantisation config's method, else
    the one `LayerBuildConfig.linear_method` picks while the model is built (the current
    quantisation config's, or the platform's unquantised method). Its `create_weights`
    registers the parameters (the plain `weight` [out_per_rank, in_per_rank], or a
    checkpoint's quantised tensors: `qweight`, `scales`, `qzeros`, ...), each tagged with
    the dims the layer shards (`output_dim`, `input_dim`; `packed_dim` and
    `packed_factor` where several values share one stored element), which is all the
    layer's `weight_loader` needs to slice any of them for this rank. A method may give a
    parameter a `weight_loader` of its own instead. After loading,
    `quant_method.process_weights_after_loading(self)` may replace the parameters by a
    platform's layout (never keeping a second copy), and every forward goes through
    `quant_method.apply`.
    """

    def __init__(
        self,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        skip_quantization: bool = False,
    ) -> None:
        super().__init__()
        build_config = get_layer_build_config()
        self.quant_method: LinearMethodBase
        # Never quantised, whatever the checkpoint's config (a MoE router, as in vLLM): the
        # loader does not ask again by name either (model_loader/utils.py).
        self.skip_quantization = skip_quantization
        if skip_quantization:
            self.quant_method = build_config.unquantized_linear_method()
        elif quant_config is None:
            self.quant_method = build_config.linear_method(self)
        else:
            self.quant_method = quant_config.get_linear_method(self) or build_config.unquantized_linear_method()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size = input_size_per_partition
        self.output_size = sum(output_partition_sizes)
        self.output_partition_sizes = list(output_partition_sizes)
        self.full_input_size, self.full_output_size = input_size, output_size
        self.params_dtype = torch.get_default_dtype()
        self.quant_method.create_weights(
            self, input_size_per_partition, self.output_partition_sizes, input_size, output_size,
            self.params_dtype, self.weight_loader,
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size), requires_grad=False)
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader, "output_dim": 0})
        else:
            self.register_parameter("bias", None)

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Replace the method and its (not yet loaded) parameters, keeping the bias: what
        the model loader does once a layer's name is known (a checkpoint that leaves some
        layers unquantised names them). Only before loading."""
        for name in [n for n, _ in self.named_parameters(recurse=False) if n != "bias"]:
            delattr(self, name)
        self.quant_method = method
        self.quant_method.create_weights(
            self, self.input_size, self.output_partition_sizes, self.full_input_size, self.full_output_size,
            self.params_dtype, self.weight_loader,
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError


def _packed_size(param: torch.Tensor, dim: int, size: int) -> int:
    """`size` values along `dim` in `param`'s stored elements: fewer where several values
    share one (`packed_dim`/`packed_factor`: int4 values eight to an int32)."""
    if getattr(param, "packed_dim", None) == dim:
        factor = param.packed_factor
        if size % factor:
            raise WeightLoadError(f"{size} values along dim {dim} do not fill whole packed elements of {factor}")
        return size // factor
    return size


def _load_output_shard(layer: LinearBase, param: nn.Parameter, loaded_weight: torch.Tensor, offset: int, size: int,
                       total: int, shard_rank: int, what: str) -> None:
    """Copy rows [shard_rank*size, +size) along the output dim of `loaded_weight` (whose
    full extent there is `total`) into `param` at `offset` (all in values, not packed
    elements). A parameter with no output dim (a per-tensor scale) must bring its own
    weight_loader."""
    dim = getattr(param, "output_dim", None)
    if dim is None:
        raise WeightLoadError(f"{what}: parameter of shape {tuple(param.shape)} has no output dim to shard; its "
                              f"quantisation method must give it a weight_loader of its own")
    size, offset, total = (_packed_size(param, dim, v) for v in (size, offset, total))
    _check_full_dim(loaded_weight, dim, total, what)
    shard = narrow_for_rank(loaded_weight, dim, size, shard_rank, what)
    copy_checked(param.data.narrow(dim, offset, size), shard)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, skip_quantization: bool = False) -> None:
        super().__init__(input_size, [output_size], input_size, output_size, bias, quant_config, skip_quantization)

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
        partitions = [divide(size, tp_size, "output_size") for size in self._output_sizes(output_size)]
        super().__init__(input_size, partitions, input_size, output_size, bias, quant_config)
        self.gather_output = gather_output

    def _output_sizes(self, output_size: int) -> list[int]:
        """The sub-projections this layer fuses (their full sizes): one, here."""
        return [output_size]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:  # not sharded (a per-tensor scale)
            load_whole(param, loaded_weight)
            return
        _check_full_dim(loaded_weight, dim, param.shape[dim] * self.tp_size, "column-parallel output dim")
        shard = narrow_for_rank(loaded_weight, dim, param.shape[dim], self.tp_rank, "column-parallel")
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

    def _output_sizes(self, output_size: int) -> list[int]:
        return list(self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise WeightLoadError(
                "a fused checkpoint tensor was given to a merged column-parallel layer; "
                "checkpoints must hold the sub-projections separately"
            )
        total = self.output_sizes[shard_id]
        _load_output_shard(self, param, loaded_weight, sum(self.output_sizes[:shard_id]) // self.tp_size,
                           total // self.tp_size, total, self.tp_rank, f"merged projection {shard_id}")


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
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp_size)
        self.num_kv_head_replicas = max(1, tp_size // total_num_kv_heads)
        # The base class divides by tp_size, so hand it the "total" that gives our per-rank width.
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size, bias,
                         quant_config=quant_config)
        self.total_output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size

    def _output_sizes(self, output_size: int) -> list[int]:
        """q, k and v, each as wide (summed over the ranks) as the ranks hold them."""
        tp_size = get_tensor_model_parallel_world_size()
        return [self.num_heads * self.head_size * tp_size] + [self.num_kv_heads * self.head_size * tp_size] * 2

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
        _load_output_shard(self, param, loaded_weight, offset, size, total_heads * self.head_size, shard_rank,
                           f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    """y = xA^T + b with A split along its input dim; partial sums are all-reduced.

    The bias is added once, after the all-reduce, so it is not counted tp_size times.
    With `reduce_results=False` the output is this rank's partial sum, rank 0's with the
    bias, and the caller sums it over the ranks (vLLM's convention; our models let the
    next RMSNorm do it, `all_reduce_input`, which the CPU runs fused with the norm).
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
        super().__init__(divide(input_size, tp_size, "input_size"), [output_size], input_size, output_size, bias,
                         quant_config)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:  # the bias, a per-channel or per-tensor scale: replicated
            load_whole(param, loaded_weight)
            return
        _check_full_dim(loaded_weight, dim, param.shape[dim] * self.tp_size, "row-parallel input dim")
        shard = narrow_for_rank(loaded_weight, dim, param.shape[dim], self.tp_rank, "row-parallel")
        load_whole(param, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)  # the bias once: after the reduce, or on rank 0's part
        if not self.reduce_results:
            return y + self.bias if self.bias is not None and self.tp_rank == 0 else y
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
