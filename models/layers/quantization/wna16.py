"""What the int4/int8 weight-only formats share: GPTQ (gptq.py), AWQ (awq.py) and
compressed-tensors W4A16/W8A16 (compressed_tensors/schemes/wna16.py).

Each registers its checkpoint's tensors with `int_parameter` (tagged for the layers'
generic weight loaders), unpacks them once loaded with `unpack_int32`, and hands the
codes, scales and zero points to `kernels.wna16_layout.set_wna16_layout`, which
replaces them by the one layout the kernels read; `apply_wna16` is every format's
forward. Called on every rank, with this rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.errors import WeightLoadError
from models.layers.quantization.base import LinearMethodBase, QuantizationConfig
from models.layers.quantization.kernels.wna16_apply import apply_wna16
from models.layers.quantization.kernels.wna16_layout import BLOCK
from models.layers.weight_utils import load_whole

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM layout: value AWQ_PACK_ORDER[j] sits at nibble j
SUPPORTED_BITS = (4, 8)


def check_bits_and_group(bits: Any, group_size: Any, bits_field: str, group_field: str) -> None:
    """Refuse (ValueError naming the field and value) what the WNA16 layout cannot hold:
    bits other than 4 and 8, and groups other than -1 (one per output row) or a positive
    multiple of the kernel's 32-input block."""
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise ValueError(f"{bits_field}={bits!r} is not supported; supported: {list(SUPPORTED_BITS)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (
            group_size == -1 or (group_size > 0 and group_size % BLOCK == 0)):
        raise ValueError(f"{group_field}={group_size!r} is not supported; supported: -1 (per channel) or a "
                         f"positive multiple of {BLOCK}")


def plan_groups(layer: nn.Module, bits: int, group_size: int, act_order: bool, input_size_per_partition: int,
                output_partition_sizes: list[int], input_size: int, field: str) -> tuple[int, bool]:
    """(groups this rank's scales and zeros hold, whether they hold every group of the
    layer) for a layer being built, after refusing what cannot be loaded (ValueError):
    inputs or outputs per rank that do not fill whole int32s of 32 / bits values, a group
    that does not divide the layer's inputs, or, when a row-parallel shard holds its own
    groups, this rank's inputs (naming `field`, the size and tensor_parallel_size).

    Per channel (-1) there is one group, held whole. With act-order (g_idx) a
    row-parallel shard's inputs fall in any group, so, as vLLM does, every rank keeps all
    groups' scales and zeros (not sliced along the inputs) and its g_idx picks them."""
    k, pack = input_size_per_partition, 32 // bits
    if k % pack or any(size % pack for size in output_partition_sizes):
        raise ValueError(f"{bits}-bit layer {type(layer).__name__} with {k} inputs and outputs "
                         f"{output_partition_sizes} per rank: both must be multiples of {pack} (values per int32)")
    if group_size == -1:
        return 1, True
    whole = act_order and input_size_per_partition != input_size
    if input_size % group_size:
        raise ValueError(f"{field}={group_size} does not divide the {input_size} input features of "
                         f"{type(layer).__name__}")
    if not whole and k % group_size:
        tp = getattr(layer, "tp_size", input_size // max(1, k))
        raise ValueError(f"{field}={group_size} does not divide this rank's {k} input features ({input_size} / "
                         f"tensor_parallel_size={tp}); use a tensor_parallel_size whose shards hold whole groups")
    return (input_size if whole else k) // group_size, whole


def input_groups(k: int, group_size: int, g_idx: torch.Tensor | None, num_groups: int) -> torch.Tensor:
    """The group of each of this rank's `k` inputs: the checkpoint's g_idx (act-order;
    checked against the `num_groups` the scales hold), else contiguous groups of
    `group_size` (-1: one group)."""
    if g_idx is not None:
        groups = g_idx.long()
        if int(groups.min()) < 0 or int(groups.max()) >= num_groups:
            raise ValueError(f"g_idx holds groups outside [0, {num_groups}) of the layer's scales")
        return groups
    if group_size == -1:
        return torch.zeros(k, dtype=torch.long)
    return torch.arange(k) // group_size


def not_converted(prefix: str, packed_modules_mapping: dict[str, tuple[str, str | int]] | None,
                  modules_to_not_convert: list[str]) -> bool:
    """Whether layer `prefix` ("model.layers.0.self_attn.qkv_proj"), that is every
    checkpoint module it fuses, is named by `modules_to_not_convert` (a name, a dotted
    suffix or one dotted component, as transformers matches them). ValueError when it
    names only some of a fused layer's modules: one layer has one method."""
    if not modules_to_not_convert:
        return False
    parent, _, leaf = prefix.rpartition(".")
    names = [f"{parent}.{sub}" if parent else sub for sub, (fused, _) in (packed_modules_mapping or {}).items()
             if fused == leaf] or [prefix]
    skipped = [any(n == m or n.endswith("." + m) or m in n.split(".") for m in modules_to_not_convert)
               for n in names]
    if any(skipped) and not all(skipped):
        raise ValueError(f"quantization_config.modules_to_not_convert names only some of the modules {names} that "
                         f"{prefix} fuses")
    return all(skipped)


def int_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  weight_loader: Callable[..., None], **dims: int) -> nn.Parameter:
    """Register an uninitialised, frozen parameter tagged with `dims` (output_dim,
    input_dim, packed_dim, packed_factor: models/layers/linear.py slices by them)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = weight_loader
    for key, value in dims.items():
        setattr(param, key, value)
    layer.register_parameter(name, param)
    return param


def fused_replica_loader(layer_loader: Callable[..., None], fused: bool) -> Callable[..., None]:
    """The weight_loader of a tensor every sub-projection of a fused layer carries whole
    (a g_idx, a weight_shape): outside a fused layer, the layer's own loader (which
    slices a row-parallel one by its input_dim); in a fused layer (q/k/v, gate/up: column
    parallel, so its inputs are whole), the first part is loaded whole and every later
    one must equal it (WeightLoadError otherwise: one permutation serves the fused
    weight; a weight_shape's output size differs per part, so only its input size is
    compared)."""
    if not fused:
        return layer_loader

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        seen = getattr(param, "_wna16_shards_seen", None)
        if seen is None or shard_id in seen:  # first part (again, on a reload): take it
            seen = set()
            load_whole(param, loaded)
        else:
            before = param.data.clone()
            load_whole(param, loaded)
            same = before[-1:] == param.data[-1:] if param.dim() == 1 and param.numel() == 2 else before == param.data
            if not bool(same.all()):
                raise WeightLoadError(f"sub-projection {shard_id!r} of a fused layer has a different "
                                      f"{tuple(param.shape)} tensor (g_idx / weight_shape) than the others")
        seen.add(shard_id)
        param._wna16_shards_seen = seen

    return load


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Values of `bits` bits packed 32 // bits to an int32 along `dim` (value j of a pack
    in bits [j*bits, (j+1)*bits); `order`: the value at position j is the pack's
    `order[j]`-th, AWQ's interleave) -> int32 [..., n * 32 // bits, ...] in [0, 2^bits)."""
    per = 32 // bits
    p = packed.movedim(dim, -1).to(torch.int32)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=p.device)
    values = torch.bitwise_and(torch.bitwise_right_shift(p.unsqueeze(-1), shifts), (1 << bits) - 1)
    if order is not None:
        inverse = [0] * per
        for j, src in enumerate(order):
            inverse[src] = j
        values = values[..., inverse]
    values = values.reshape(*p.shape[:-1], p.shape[-1] * per)
    return values.movedim(-1, dim)


class WNA16LinearMethod:
    """What every int4/int8 weight-only method shares (mixed into each format's
    LinearMethodBase): its format's config, and the forward, y = x W^T (+ bias) from the
    WNA16 layout."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_wna16(layer, x, bias)


class WNA16Config(QuantizationConfig):
    """What GPTQConfig and AWQConfig share: `modules_to_not_convert` (layers left
    unquantised) and the per-layer choice of `linear_method_cls(self)`."""

    linear_method_cls: type[LinearMethodBase]
    modules_to_not_convert: list[str]

    @staticmethod
    def parse_modules_to_not_convert(hf_quant_config: dict[str, Any]) -> list[str]:
        skip = hf_quant_config.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise ValueError(f"quantization_config.modules_to_not_convert must be a list of names, got {skip!r}")
        return skip

    def get_linear_method(self, layer: nn.Module, prefix: str = "",
                          packed_modules_mapping: dict[str, tuple[str, str | int]] | None = None
                          ) -> LinearMethodBase | None:
        if prefix and not_converted(prefix, packed_modules_mapping, self.modules_to_not_convert):
            return None
        current = getattr(layer, "quant_method", None)
        return current if isinstance(current, self.linear_method_cls) else self.linear_method_cls(self)
