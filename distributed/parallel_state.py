"""The tensor-parallel group handle: the one piece of global state we keep.

Who calls this: `Worker.init_device()` calls `init_distributed_environment` once per
process, on every rank, with the same world size and init method; the parallel layers
in `models/layers/` read rank and size while they are built, and call the collectives
(`distributed.communication_op`) in their forward pass. With no group set, the process
is rank 0 of 1 and every collective is the identity, so a model can be built and run at
TP=1 with no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from distributed.device_communicators import DeviceCommunicatorBase, get_device_communicator_cls


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    communicator: DeviceCommunicatorBase | None  # None when world_size == 1


_TP = TensorParallelGroup(rank=0, world_size=1, communicator=None)

# `distributed_init_method` "tcpstore://HOST:PORT": join through a torch TCPStore that is
# already served at HOST:PORT (the mp executor serves one on 127.0.0.1 in the engine).
TCP_STORE_SCHEME = "tcpstore://"


def set_tensor_parallel_group(rank: int, world_size: int, communicator: DeviceCommunicatorBase | None) -> None:
    """Install this process's TP group (`communicator` None only at world_size 1).
    `init_distributed_environment` calls this; tests that build their own process
    group call it directly."""
    global _TP
    if not 0 <= rank < world_size:
        raise ValueError(f"tp rank {rank} is outside [0, {world_size})")
    if world_size > 1 and communicator is None:
        raise ValueError(f"tp world size {world_size} needs a device communicator")
    _TP = TensorParallelGroup(rank=rank, world_size=world_size, communicator=communicator)


def get_tp_group() -> TensorParallelGroup:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str | None, device: torch.device
) -> None:
    """Join the TP process group with the communicator of `device`'s platform (NCCL
    on CUDA, gloo on the CPU) and install it as this process's TP group. At
    world_size 1 nothing is created.

    Every rank calls this with the same `world_size` and `distributed_init_method`;
    it returns once all of them have joined (one barrier, so a broken rendezvous fails
    here rather than in the first forward). Besides torch's init methods (tcp://,
    file://, env://), "tcpstore://HOST:PORT" joins a TCPStore served by someone else. Raises ValueError without an init method
    at world_size > 1, and whatever torch.distributed raises on a failed rendezvous.
    """
    if world_size == 1:
        set_tensor_parallel_group(0, 1, None)
        return
    if distributed_init_method is None:
        raise ValueError(f"rank {rank}: tensor_parallel_size {world_size} needs a distributed_init_method")
    communicator_cls = get_device_communicator_cls(device.type)
    rendezvous: dict[str, Any] = {"init_method": distributed_init_method}
    if distributed_init_method.startswith(TCP_STORE_SCHEME):
        # A store someone else (the engine) serves: we only connect, so nothing binds a
        # port or writes a file here.
        host, _, port = distributed_init_method.removeprefix(TCP_STORE_SCHEME).rpartition(":")
        store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timedelta(seconds=300))
        rendezvous = {"store": store}
    dist.init_process_group(
        backend=communicator_cls.dist_backend,
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None,
        **rendezvous,
    )
    group = dist.group.WORLD
    set_tensor_parallel_group(rank, world_size, communicator_cls(rank, world_size, group))
    dist.barrier()


class _ObservedCommunicator:
    """A communicator that reports entering and leaving each collective (the worker's
    liveness board: a rank waiting in a collective is waiting for a peer, not hung)."""

    def __init__(self, inner: DeviceCommunicatorBase, on_enter: Callable[[], None],
                 on_exit: Callable[[], None]) -> None:
        self._inner = inner
        self._on_enter = on_enter
        self._on_exit = on_exit

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._on_enter()
        try:
            return self._inner.all_reduce(x)
        finally:
            self._on_exit()

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._on_enter()
        try:
            return self._inner.all_gather(x, dim)
        finally:
            self._on_exit()

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, norm_kernel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        self._on_enter()
        try:
            return self._inner.all_reduce_rms_norm(x, residual, weight, eps, norm_kernel)
        finally:
            self._on_exit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def observe_collectives(on_enter: Callable[[], None], on_exit: Callable[[], None]) -> None:
    """Have every TP collective of this process call `on_enter()` before and `on_exit()`
    after it (also when it raises). Called once, after `init_distributed_environment`;
    a no-op at world size 1 (no collectives)."""
    global _TP
    if _TP.communicator is None:
        return
    observed = _ObservedCommunicator(_TP.communicator, on_enter, on_exit)
    _TP = TensorParallelGroup(_TP.rank, _TP.world_size, observed)  # type: ignore[arg-type]


def destroy_distributed_environment() -> None:
    """Leave the process group and go back to rank 0 of 1. Safe to call more than once,
    and with no group (worker shutdown, tests)."""
    global _TP
    if _TP.communicator is not None:
        _TP.communicator.destroy()
    _TP = TensorParallelGroup(rank=0, world_size=1, communicator=None)
    if dist.is_initialized():
        dist.destroy_process_group()
