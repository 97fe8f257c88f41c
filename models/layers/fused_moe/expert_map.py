"""Expert parallelism: which experts a rank holds, and which checkpoint tensors it reads.

With `enable_expert_parallel` the EP group is the TP group (EP size = TP size): rank r
holds the whole experts [r*E/ep, (r+1)*E/ep), unsliced, and computes only the tokens
routed to them. Without it every rank holds every expert (each one's intermediate
dimension sliced by TP) and this placement is the trivial one (all experts local).

Built once per FusedMoE layer while the model is built (`determine_expert_placement`,
which reads this process's TP rank and size), and once per model for the loader's name
filter (`ExpertPlacement.is_local_checkpoint_tensor`); the result is a plain value,
identical for every layer of a model on one rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

# `....experts.<id>.<anything>`: a per-expert checkpoint tensor (both families' names).
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.")


class ExpertParallelConfigError(ValueError):
    """The experts cannot be split evenly over the ranks; the message names both numbers."""


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int  # E, in the checkpoint
    ep_rank: int
    ep_size: int  # 1 without expert parallelism

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def local_expert_id(self, expert_id: int) -> int | None:
        """This rank's index of global expert `expert_id`, or None when another rank holds it."""
        local = expert_id - self.first_local_expert
        return local if 0 <= local < self.num_local_experts else None

    def expert_map(self, device: torch.device | None = None) -> torch.Tensor:
        """[E] int64: global expert id -> local index, -1 for the experts of other ranks."""
        mapping = torch.full((self.num_experts,), -1, dtype=torch.int64, device=device)
        mapping[self.first_local_expert:self.first_local_expert + self.num_local_experts] = torch.arange(
            self.num_local_experts, device=device)
        return mapping

    def is_local_checkpoint_tensor(self, name: str) -> bool:
        """False only for a per-expert tensor (`...experts.<id>....`) of another rank's
        expert: the model loader drops such names before any of their bytes is read."""
        match = _EXPERT_TENSOR.search(name)
        return match is None or self.local_expert_id(int(match.group(1))) is not None


def determine_expert_placement(num_experts: int, enable_expert_parallel: bool) -> ExpertPlacement:
    """This rank's placement. Under expert parallelism E must divide evenly over the TP
    ranks, else `ExpertParallelConfigError` names num_experts and the TP size."""
    if not enable_expert_parallel:
        return ExpertPlacement(num_experts, 0, 1)
    tp_size = get_tensor_model_parallel_world_size()
    if num_experts % tp_size:
        raise ExpertParallelConfigError(
            f"expert parallelism needs num_experts={num_experts} divisible by the EP size, which is the "
            f"tensor_parallel_size={tp_size}; use a TP size that divides {num_experts}, or turn "
            "enable_expert_parallel off (every expert is then sliced across the ranks)"
        )
    return ExpertPlacement(num_experts, get_tensor_model_parallel_rank(), tp_size)
