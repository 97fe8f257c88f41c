"""ParallelConfig: how many ranks, and which executor starts them."""

from __future__ import annotations

from dataclasses import dataclass

# How the placement group of one bundle per rank is placed (Ray's names); PACK is the default.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

# How the TP ranks exchange tensors. "auto": NCCL on CUDA (one device per rank), gloo with
# the shared-memory fast path on the CPU. "gloo" on CUDA stages each collective through
# host memory, which lets several ranks share one GPU (tests, single-GPU CI runners).
TP_COMMUNICATORS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # A registered backend name (executor/registry.py) or an Executor subclass; None
    # means "uni" at tp=1 and "mp" above (Executor.get_class).
    distributed_executor_backend: str | type | None = None
    # "ray" only: PACK fills as few nodes as possible, SPREAD puts ranks on different nodes.
    ray_placement_strategy: str = "PACK"
    # One of TP_COMMUNICATORS, resolved: "nccl" or "gloo".
    tp_communicator: str = "gloo"
    # Mixture-of-experts layers: whole experts per rank (EP size = TP size) instead of
    # every expert's intermediate dimension split across the ranks (vLLM's flag).
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size
