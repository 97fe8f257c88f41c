"""Routing a checkpoint's per-expert tensors into FusedMoE layers.

Used by a MoE architecture's `load_weights` on every rank: `ExpertWeightsLoader.route`
wraps the (name, tensor) stream, hands every `<prefix>.experts.<id>.<proj>.<suffix>`
whose suffix the layer's method holds ("weight"; fp8 also "weight_scale_inv" or
"weight_scale"; int4/int8 "qweight", "scales", ... ) to the FusedMoE at
`<prefix>.experts` through its `weight_loader(param, tensor, weight_name, shard_id,
expert_id)`, drops those whose suffix the method ignores (`ignored_expert_suffixes`),
and passes every other tensor on (to AutoWeightsLoader). `finish()` then raises
`WeightLoadError` naming every local expert tensor the checkpoint lacked, by its
checkpoint name, and returns the stacked parameters that are complete. A stream with no
expert tensor at all (the dummy loader, which fills the stacked parameters itself) is
not an error here: the loader's strict all-parameters check then names each stacked
parameter it did not fill. Holds no tensor; one instance per load.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from models.errors import WeightLoadError
from models.layers.fused_moe.layer import FusedMoE
from models.utils import format_names

_EXPERT_WEIGHT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<suffix>\w+)$")


class ExpertWeightsLoader:
    """`proj_to_shard`: the checkpoint's projection names -> "w1" | "w2" | "w3", e.g.
    Qwen3-MoE's {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}."""

    def __init__(self, model: nn.Module, proj_to_shard: dict[str, str]) -> None:
        self.proj_to_shard = proj_to_shard
        self.shard_to_proj = {shard: proj for proj, shard in proj_to_shard.items()}
        self.layers: dict[str, FusedMoE] = {
            name: module for name, module in model.named_modules() if isinstance(module, FusedMoE)
        }
        # Each layer's stacked parameters by checkpoint suffix, looked up once, not per tensor.
        self.suffixes = {name: layer.expert_suffixes() for name, layer in self.layers.items()}
        self.ignored = {name: layer.quant_method.ignored_expert_suffixes for name, layer in self.layers.items()}
        self.num_routed = 0

    def route(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            match = _EXPERT_WEIGHT.match(name)
            layer = self.layers.get(match["module"]) if match else None
            shard_id = self.proj_to_shard.get(match["proj"]) if match else None
            params = self.suffixes[match["module"]].get(match["suffix"]) if layer is not None else None
            if params is None and shard_id is not None and match["suffix"] in self.ignored[match["module"]]:
                continue  # metadata the layer's method does not read (GPTQ's g_idx, a weight_shape)
            if params is None or shard_id is None:
                yield name, tensor  # not an expert tensor: AutoWeightsLoader's (or unexpected)
                continue
            expert_id = int(match["expert"])
            if expert_id >= layer.num_experts:
                raise WeightLoadError(f"checkpoint tensor {name!r} names expert {expert_id}, but the model has "
                                      f"num_experts={layer.num_experts}")
            param = params[1] if shard_id == "w2" else params[0]
            param.weight_loader(param, tensor, name, shard_id, expert_id)
            self.num_routed += 1

    def finish(self) -> set[str]:
        """The stacked parameter names now complete; raises naming every missing expert tensor."""
        if self.num_routed == 0:
            return set()
        missing = [
            f"{prefix}.{expert}.{self.shard_to_proj[shard]}.{suffix}"
            for prefix, layer in self.layers.items() for expert, shard, suffix in layer.missing_expert_shards()
        ]
        if missing:
            raise WeightLoadError(f"{len(missing)} expert tensor(s) of this rank's experts are missing from the "
                                  f"checkpoint: {format_names(missing)}")
        return {f"{prefix}.{name}" for prefix, layer in self.layers.items()
                for name, param in layer.named_parameters(recurse=False) if hasattr(param, "expert_suffix")}
