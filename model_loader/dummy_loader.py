"""DummyModelLoader (load_format="dummy"): deterministic random weights, no files read.

For profiling and benchmarks without a checkpoint (only config.json is needed). Every
value is uniform in [-1e-3, 1e-3] (norm weights too, as in vLLM), drawn from a
generator seeded by a stable hash of the CHECKPOINT-level tensor name and
`config.seed`. So the weights are identical across runs, processes and machines, and
across TP sizes: the loader generates the FULL (unsharded) tensor of each checkpoint
name and feeds it through the model's normal `load_weights` path, where the layers'
weight_loaders cut out this rank's slice. Rank r's shard at TP=n therefore equals the
slice of the TP=1 weights.

Checkpoint names and full shapes come from the model itself: each parameter's module,
the model's `packed_modules_mapping` (a fused `qkv_proj` becomes full `q_proj`,
`k_proj`, `v_proj` tensors; `gate_up_proj` becomes `gate_proj`, `up_proj`) and the
parallel layer's unsharded sizes. A parameter this loader does not know how to unshard
(e.g. a quantisation scale added by some other layer type) is filled directly with
values seeded by its parameter name: still deterministic, identical on every rank.

Memory: one full checkpoint tensor at a time on top of the parameters (the largest is
the embedding; tp_size times its shard).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from model_loader.base_loader import BaseModelLoader
from model_loader.default_loader import check_all_weights_loaded
from model_loader.multithread import check_extra_config_keys
from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from models.layers.vocab_parallel_embedding import VocabParallelEmbedding
from models.layers.weight_utils import default_weight_loader

if TYPE_CHECKING:
    from config import LoadConfig, ModelConfig

DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3
_GENERATABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def dummy_seed(name: str, seed: int) -> int:
    """A stable 63-bit seed for `name` (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dummy_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    """The dummy values of checkpoint tensor `name` (full shape), uniform in [-1e-3, 1e-3]."""
    gen_dtype = dtype if dtype in _GENERATABLE else torch.float32
    generator = torch.Generator(device=device).manual_seed(dummy_seed(name, seed))
    out = torch.empty(shape, dtype=gen_dtype, device=device)
    out.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator)
    return out if gen_dtype == dtype else out.to(dtype)


def _full_shape(module: nn.Module, param_name: str, param: torch.Tensor, shard_id: Any) -> tuple[int, ...] | None:
    """The unsharded checkpoint shape of `module.<param_name>` (for `shard_id` of a fused
    layer), or None when this loader cannot tell."""
    if param_name not in ("weight", "bias"):
        return None
    is_bias = param_name == "bias"
    if isinstance(module, QKVParallelLinear):
        if shard_id not in ("q", "k", "v"):
            return None
        heads = module.total_num_heads if shard_id == "q" else module.total_num_kv_heads
        rows = heads * module.head_size
        return (rows,) if is_bias else (rows, module.input_size)
    if isinstance(module, MergedColumnParallelLinear):
        if not isinstance(shard_id, int):
            return None
        rows = module.output_sizes[shard_id]
        return (rows,) if is_bias else (rows, module.input_size)
    if shard_id is not None:
        return None
    if isinstance(module, ColumnParallelLinear):
        rows = module.total_output_size
        return (rows,) if is_bias else (rows, module.input_size)
    if isinstance(module, RowParallelLinear):
        return (module.output_size,) if is_bias else (module.output_size, module.total_input_size)
    if isinstance(module, VocabParallelEmbedding):
        return None if is_bias else (module.num_embeddings, module.embedding_dim)
    if isinstance(module, ReplicatedLinear) or getattr(param, "weight_loader", None) is default_weight_loader:
        return tuple(param.shape)  # replicated (norms, ...): the same on every rank
    return None


LoaderPlan = list[tuple[str, tuple[int, ...], nn.Parameter]]


def plan_dummy_weights(model: nn.Module) -> tuple[LoaderPlan, list[tuple[str, nn.Parameter]]]:
    """([(checkpoint name, full shape, param)], [(param name, param) to fill directly])."""
    fused_to_ckpt: dict[str, list[tuple[str, Any]]] = {}
    for ckpt_sub, (fused, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        fused_to_ckpt.setdefault(fused, []).append((ckpt_sub, shard_id))
    seen: set[int] = set()
    via_loader: list[tuple[str, tuple[int, ...], nn.Parameter]] = []
    direct: list[tuple[str, nn.Parameter]] = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied: filled through the first name that holds it
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            parent, _, leaf = module_name.rpartition(".")
            shards = fused_to_ckpt.get(leaf)
            if shards:
                plans = []
                for ckpt_sub, shard_id in shards:
                    shape = _full_shape(module, param_name, param, shard_id)
                    if shape is None:
                        break
                    ckpt_module = f"{parent}.{ckpt_sub}" if parent else ckpt_sub
                    plans.append((f"{ckpt_module}.{param_name}", shape, param))
                else:
                    via_loader.extend(plans)
                    continue
                direct.append((full_name, param))
                continue
            shape = _full_shape(module, param_name, param, None)
            if shape is None:
                direct.append((full_name, param))
            else:
                via_loader.append((full_name, shape, param))
    return via_loader, direct


class DummyModelLoader(BaseModelLoader):
    """Random but reproducible weights; see the module docstring."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        check_extra_config_keys(load_config.model_loader_extra_config, {}, load_config.load_format)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        seed = model_config.seed
        via_loader, direct = plan_dummy_weights(model)

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, shape, param in via_loader:
                yield name, dummy_tensor(name, shape, param.dtype, param.device, seed)

        loaded = set(model.load_weights(stream()))
        for name, param in direct:
            param.data.copy_(dummy_tensor(name, tuple(param.shape), param.dtype, param.device, seed))
            loaded.add(name)
        check_all_weights_loaded(model, loaded, f"the dummy loader (seed {seed})")
