"""ParallelConfig: how many ranks, and which executor starts them."""

from __future__ import annotations

from dataclasses import dataclass

# How the placement group of one bundle per rank is placed (Ray's names); PACK is the default.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # A registered backend name (executor/registry.py) or an Executor subclass; None
    # means "uni" at tp=1 and "mp" above (Executor.get_class).
    distributed_executor_backend: str | type | None = None
    # "ray" only: PACK fills as few nodes as possible, SPREAD puts ranks on different nodes.
    ray_placement_strategy: str = "PACK"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size
