"""GGUF (llama.cpp) weights kept in their block formats: vLLM's GGUFConfig.

The engine's resolution step reads the file's header (`model_loader.gguf_utils`) and,
when any linear or embedding tensor has a type we hold quantised (Q4_0, Q8_0, Q4_K,
Q5_K, Q6_K), sets `hf_config.quantization_config` to

    {"quant_method": "gguf", "tensor_types": {checkpoint module: held type}}

naming every linear module of a layer that holds blocks ("model.layers.0.mlp.down_proj":
"Q6_K"), and "model.embed_tokens" / "lm_head" when those do. Fused layers (q/k/v,
gate/up) hold one block run per shard, each of its own type, as llama.cpp's Q4_K_M
mixes them; a shard whose file type we have no kernel for is held dequantised, as
"F32". A layer none of whose modules is named keeps the plain method (F16/BF16/F32
files stay 16/32-bit).

A mixture of experts' stacked experts (qwen3moe) are named per stack
("model.layers.0.mlp.experts.down_proj": "Q6_K") and held as blocks by gguf_moe.py's
`GGUFMoEMethod`, which a FusedMoE gets once the loader knows its name
(`selects_moe_by_name`).

Every rank builds the same config from that dict. Memory: each layer holds one uint8
parameter `qweight`, this rank's rows (column-parallel: whole rows, never a split
block) or this rank's blocks of every row (row-parallel: the per-rank input size is a
whole number of blocks, which the resolution step checks), shard after shard; its
bytes are the file's bytes for this rank's share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models.errors import WeightLoadError
from models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from models.layers.quantization.base import LinearMethodBase, QuantizationConfig
from models.layers.quantization.gguf_dequant import (
    FLOAT_TYPES,
    GGUF_FORMATS,
    dequantize,
    row_bytes,
)
from models.layers.quantization.gguf_kernels import (
    ShardPlan,
    gguf_dequantize_rows,
    gguf_linear,
    gguf_linear_shards,
    shard_plan,
)
from models.layers.quantization.gguf_moe import GGUFMoEMethod

_QKV_ORDER = "qkv"


def _as_blocks(loaded: torch.Tensor, qtype: str) -> torch.Tensor:
    """A checkpoint tensor as [rows, row_bytes] uint8: block bytes as they are, a float
    tensor (a shard held as F32/F16/BF16) as its raw values."""
    if loaded.dtype == torch.uint8:
        return loaded
    if qtype not in FLOAT_TYPES:
        raise WeightLoadError(f"a {qtype} shard needs its block bytes (uint8), got a {loaded.dtype} tensor")
    return loaded.to(FLOAT_TYPES[qtype]).contiguous().view(torch.uint8)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """A product's output dtype: the kernels round each float sum once to x's dtype where
    they can write it (as `.to` would round a float32 output), so a 16-bit layer needs no
    float32 output and cast; other dtypes get float32, cast after."""
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


class GGUFLinearMethod(LinearMethodBase):
    """One layer's weight as runs of GGUF blocks, one run per shard (`shard_types`, in
    the layer's shard order: q, k, v; gate, up; or one). Built per layer by
    GGUFConfig."""

    def __init__(self, shard_types: list[str]) -> None:
        self.shard_types = list(shard_types)
        self.shards: list[tuple[str, int, int, int]] = []  # (type, rows, row_bytes, byte offset)
        self.input_size = 0
        self._plan: tuple[int, ShardPlan | None] | None = None  # (qweight's address, its plan)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        if len(output_partition_sizes) != len(self.shard_types):
            raise ValueError(f"GGUF: {len(self.shard_types)} shard types for a layer of "
                             f"{len(output_partition_sizes)} shards")
        self.input_size = input_size_per_partition
        self.shards, offset = [], 0
        for qtype, rows in zip(self.shard_types, output_partition_sizes):
            nbytes = row_bytes(qtype, input_size_per_partition)  # ValueError: not whole blocks on this rank
            self.shards.append((qtype, rows, nbytes, offset))
            offset += rows * nbytes
        qweight = nn.Parameter(torch.empty(offset, dtype=torch.uint8), requires_grad=False)
        qweight.weight_loader = functools.partial(self._load_shard, layer)
        layer.register_parameter("qweight", qweight)

    def _load_shard(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: str | int | None = None) -> None:
        """This rank's part of one shard's [rows, row_bytes] blocks: whole rows of a
        column-parallel layer (a k/v shard's rows from the rank holding that KV head), or
        the rank's run of blocks in every row of a row-parallel one."""
        index = 0 if shard_id is None else _QKV_ORDER.index(shard_id) if isinstance(shard_id, str) else shard_id
        qtype, rows, nbytes, offset = self.shards[index]
        blocks = _as_blocks(loaded, qtype)
        shard_rank, total = layer.tp_rank, rows * layer.tp_size
        if isinstance(layer, QKVParallelLinear):
            heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
            total = heads * layer.head_size
            if shard_id != "q":
                shard_rank = layer.tp_rank // layer.num_kv_head_replicas
        part = None
        if isinstance(layer, RowParallelLinear):
            if blocks.shape == (rows, nbytes * layer.tp_size):
                part = blocks.narrow(1, layer.tp_rank * nbytes, nbytes)
        elif isinstance(layer, ColumnParallelLinear):
            if blocks.shape == (total, nbytes):
                part = blocks.narrow(0, shard_rank * rows, rows)
        elif blocks.shape == (rows, nbytes):
            part = blocks
        if part is None:
            raise WeightLoadError(f"shape mismatch (GGUF {qtype} shard {shard_id!r}): this rank takes {rows} rows of "
                                  f"{nbytes} bytes from a tensor of {tuple(blocks.shape)} bytes")
        param.data[offset:offset + rows * nbytes].view(rows, nbytes).copy_(part)

    def shard_blocks(self, layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """(type, [rows, row_bytes] view of `qweight`) per shard, in output order."""
        return [(qtype, layer.qweight[offset:offset + rows * nbytes].view(rows, nbytes))
                for qtype, rows, nbytes, offset in self.shards]

    def shard_plan(self, layer: nn.Module) -> ShardPlan | None:
        """The shards as one kernel call (`gguf_linear_shards`), built on first use and
        again whenever `qweight`'s storage has moved (sleep and wake)."""
        address = layer.qweight.data_ptr()
        if self._plan is None or self._plan[0] != address:
            self._plan = (address, shard_plan(self.shard_blocks(layer)))
        return self._plan[1]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.input_size)
        out = torch.empty(x2.shape[0], sum(rows for _, rows, _, _ in self.shards), dtype=_out_dtype(x),
                          device=x.device)
        if not gguf_linear_shards(self.shard_plan(layer), self.input_size, x2, out):
            start = 0
            for qtype, blocks in self.shard_blocks(layer):
                gguf_linear(qtype, blocks, self.input_size, x2, out[:, start:start + blocks.shape[0]])
                start += blocks.shape[0]
        y = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[1])
        return y + bias if bias is not None else y

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """This rank's weight [out, in] as float32 values (for inspection and tests; a
        new tensor of the plain weight's size)."""
        return torch.cat([dequantize(qtype, blocks, self.input_size) for qtype, blocks in self.shard_blocks(layer)])


class GGUFEmbeddingMethod:
    """A vocabulary table held as GGUF blocks: the embedding's lookups dequantise only the
    looked-up rows, and as an LM head (`apply`) the logits come from the blocks through
    the linear kernels. The table is this rank's [rows, row_bytes] `qweight`."""

    def __init__(self, qtype: str) -> None:
        self.qtype = qtype

    def create_weights(self, layer: nn.Module, rows: int, embedding_dim: int,
                       weight_loader: Callable[..., None]) -> None:
        nbytes = row_bytes(self.qtype, embedding_dim)
        qweight = nn.Parameter(torch.empty(rows, nbytes, dtype=torch.uint8), requires_grad=False)
        qweight.weight_loader = weight_loader
        layer.register_parameter("qweight", qweight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to repack: the kernels read the file's blocks as they are."""

    def embedding(self, layer: nn.Module, local_ids: torch.Tensor) -> torch.Tensor:
        """[*ids.shape, embedding_dim] float32 rows of this rank's table."""
        rows = gguf_dequantize_rows(self.qtype, layer.qweight, layer.embedding_dim, local_ids.reshape(-1))
        return rows.reshape(*local_ids.shape, layer.embedding_dim)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, layer.embedding_dim)
        out = torch.empty(x2.shape[0], layer.qweight.shape[0], dtype=_out_dtype(x), device=x.device)
        gguf_linear(self.qtype, layer.qweight, layer.embedding_dim, x2, out)
        y = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[1])
        return y + bias if bias is not None else y

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return dequantize(self.qtype, layer.qweight, layer.embedding_dim)


class GGUFConfig(QuantizationConfig):
    """The held type of every GGUF module that keeps blocks (see the module docstring)."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, str]) -> None:
        self.tensor_types = dict(tensor_types)

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> GGUFConfig:
        if not isinstance(hf_quant_config, dict) or hf_quant_config.get("quant_method") != "gguf":
            raise ValueError("quantization 'gguf' is set from a GGUF file's header (load_format='gguf'); "
                             f"got quantization_config={hf_quant_config!r}")
        types = hf_quant_config.get("tensor_types")
        if not isinstance(types, dict):
            raise ValueError(  # noqa: TRY004 - from_config's contract: ValueError, which resolution reports
                f"quantization_config.tensor_types must map module names to GGUF types, got {types!r}")
        bad = {name: t for name, t in types.items() if t not in GGUF_FORMATS}
        if bad:
            raise ValueError(f"quantization_config.tensor_types holds types with no GGUF kernel: {bad}; "
                             f"supported: {list(GGUF_FORMATS)}")
        return cls(types)

    def get_linear_method(self, layer: nn.Module, prefix: str = "",
                          packed_modules_mapping: dict[str, tuple[str, str | int]] | None = None
                          ) -> LinearMethodBase | None:
        if not prefix:  # while building: the plain method until the layer is named
            return None
        parent, _, leaf = prefix.rpartition(".")
        parts = sorted(((sid, sub) for sub, (fused, sid) in (packed_modules_mapping or {}).items() if fused == leaf),
                       key=lambda p: _QKV_ORDER.index(p[0]) if isinstance(p[0], str) else p[0])
        names = [f"{parent}.{sub}" if parent else sub for _, sub in parts] or [prefix]
        types = [self.tensor_types.get(n) for n in names]
        if all(t is None for t in types):
            return None
        if any(t is None for t in types):
            raise ValueError(f"quantization_config.tensor_types names only some of the modules {names} that "
                             f"{prefix} fuses: {types}")
        current = getattr(layer, "quant_method", None)
        if isinstance(current, GGUFLinearMethod) and current.shard_types == types:
            return current
        return GGUFLinearMethod(types)

    selects_moe_by_name = True  # the experts' types come per layer

    def moe_unsupported_reason(self, expert_names: list[list[str]] | None = None) -> str | None:
        return None

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> GGUFMoEMethod | None:
        """The experts held as blocks (gguf_moe.GGUFMoEMethod) where `tensor_types` names
        the layer's stacks (`<prefix>.gate_proj` ...), else None: float experts (F16/F32
        files, or stacks held dequantised), and every layer before it is named."""
        if not prefix:
            return None
        names = [f"{prefix}.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
        gate, up, down = (self.tensor_types.get(n) for n in names)
        if gate is None and up is None and down is None:
            return None
        if gate is None or down is None or gate != up:
            raise ValueError(f"quantization_config.tensor_types holds the experts {names} as {[gate, up, down]}: "
                             "gate and up of one type, and down, are needed")
        return GGUFMoEMethod(gate, down)

    def get_embedding_method(self, role: str) -> GGUFEmbeddingMethod | None:
        """The table's method for "embed_tokens" (token_embd) or "lm_head" (output), None
        to keep it plain."""
        qtype = self.tensor_types.get("model.embed_tokens" if role == "embed_tokens" else role)
        return GGUFEmbeddingMethod(qtype) if qtype is not None else None

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        return f"GGUFConfig({counts})"
