"""The tensor-parallel group handle: the one piece of global state we keep.

Who calls this: `Worker.init_device()` calls `init_distributed_environment` once per
process, on every rank, with the same world size and init method; the parallel layers
in `models/layers/` read rank and size while they are built, and call the collectives
(`distributed.communication_op`) in their forward pass; the WorkerProc has every
collective, and the runner's wait at the device sync (`device_sync_point`), reported to
the liveness board (`observe_collectives`). With no group set, the process is rank 0 of
1 and every collective is the identity, so a model can be built and run at TP=1 with no
process group.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ContextManager

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

# How long one TP collective may wait for its peers before it raises (gloo, the
# shared-memory path) or NCCL's watchdog ends the process (torch's default
# TORCH_NCCL_ASYNC_ERROR_HANDLING=3), so that a lost peer is never waited for forever
# (the external launcher has no engine monitor to notice it). The longest wait a healthy
# group has is a rank that waits in its first collective for a peer still loading its
# weights, which the engine bounds by its start-up timeout (TP_WORKER_STARTUP_TIMEOUT,
# 600 s): this matches it.
DEFAULT_TP_COLLECTIVE_TIMEOUT_S = 600.0


def tp_collective_timeout() -> timedelta:
    """The collective timeout: TP_COLLECTIVE_TIMEOUT (seconds) if set, else
    DEFAULT_TP_COLLECTIVE_TIMEOUT_S. Read when called, not at import: a worker forked
    from a forkserver adopts the engine's TP_* variables after its imports."""
    return timedelta(seconds=float(os.environ.get("TP_COLLECTIVE_TIMEOUT", DEFAULT_TP_COLLECTIVE_TIMEOUT_S)))


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
    world_size: int, rank: int, distributed_init_method: str | None, device: torch.device,
    tp_communicator: str = "auto", timeout: timedelta | None = None,
) -> None:
    """Join the TP process group with the communicator `get_device_communicator_cls(
    device.type, tp_communicator)` picks (NCCL or gloo staged through host memory on
    CUDA, gloo on the CPU; "auto": the device's default) and install it as this
    process's TP group. At world_size 1 nothing is created.

    Every rank calls this with the same `world_size`, `distributed_init_method`,
    `tp_communicator` and `timeout`; it returns once all of them have joined (one
    barrier, so a broken rendezvous fails here rather than in the first forward). A
    collective that waits for its peers longer than `timeout` (None:
    `tp_collective_timeout()`) raises (NCCL: the watchdog ends the process). Besides
    torch's init methods (tcp://, file://, env://), "tcpstore://HOST:PORT" joins a
    TCPStore served by someone else. Raises ValueError
    without an init method at world_size > 1 or for a communicator the device cannot
    use, and whatever torch.distributed raises on a failed rendezvous.
    """
    if world_size == 1:
        set_tensor_parallel_group(0, 1, None)
        return
    if distributed_init_method is None:
        raise ValueError(f"rank {rank}: tensor_parallel_size {world_size} needs a distributed_init_method")
    communicator_cls = get_device_communicator_cls(device.type, tp_communicator)
    timeout = timeout if timeout is not None else tp_collective_timeout()
    rendezvous: dict[str, Any] = {"init_method": distributed_init_method}
    if distributed_init_method.startswith(TCP_STORE_SCHEME):
        # A store someone else (the engine) serves: we only connect, so nothing binds a
        # port or writes a file here.
        host, _, port = distributed_init_method.removeprefix(TCP_STORE_SCHEME).rpartition(":")
        store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timedelta(seconds=300))
        rendezvous = {"store": store}
    nccl = communicator_cls.dist_backend == "nccl"
    dist.init_process_group(
        backend=communicator_cls.dist_backend,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        # Binds NCCL's communicator to this rank's device at once; gloo takes none (its
        # ranks may share a device).
        device_id=device if nccl else None,
        **rendezvous,
    )
    group = dist.group.WORLD
    set_tensor_parallel_group(rank, world_size, communicator_cls(rank, world_size, group, timeout))
    dist.barrier()


class _CollectiveMark:
    """A context manager that calls `on_enter()` on entry and `on_exit()` on exit (also
    when the block raises): one collective, or one wait at the device sync point."""

    __slots__ = ("_on_enter", "_on_exit")

    def __init__(self, on_enter: Callable[[], None], on_exit: Callable[[], None]) -> None:
        self._on_enter = on_enter
        self._on_exit = on_exit

    def __enter__(self) -> None:
        self._on_enter()

    def __exit__(self, *exc: object) -> None:
        self._on_exit()


class _ObservedCommunicator:
    """A communicator that reports entering and leaving each collective (the worker's
    liveness board: a rank waiting in a collective is waiting for a peer, not hung)."""

    def __init__(self, inner: DeviceCommunicatorBase, on_enter: Callable[[], None],
                 on_exit: Callable[[], None]) -> None:
        self._inner = inner
        self.mark = _CollectiveMark(on_enter, on_exit)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        with self.mark:
            return self._inner.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        with self.mark:
            return self._inner.all_gather(x, dim)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, norm_kernel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self.mark:
            return self._inner.all_reduce_rms_norm(x, residual, weight, eps, norm_kernel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def observe_collectives(on_enter: Callable[[], None], on_exit: Callable[[], None]) -> None:
    """Have every TP collective of this process call `on_enter()` before and `on_exit()`
    after it (also when it raises), and so does `device_sync_point()` where the
    communicator's collectives complete at the device sync. Called once, after
    `init_distributed_environment`; a no-op at world size 1 (no collectives)."""
    global _TP
    if _TP.communicator is None:
        return
    observed = _ObservedCommunicator(_TP.communicator, on_enter, on_exit)
    _TP = TensorParallelGroup(_TP.rank, _TP.world_size, observed)  # type: ignore[arg-type]


_NO_MARK = contextlib.nullcontext()


def device_sync_point() -> ContextManager[None]:
    """Wrap the host's wait for the device's stream in it (the runner's `.tolist()` of
    the sampled ids): where the TP collectives only queue work on the stream (NCCL), the
    wait for the peers happens there, so the rank is marked "in a collective" on the
    liveness board for the block's duration, through the hooks `observe_collectives`
    installed. A no-op (one shared null context) at world size 1, without hooks, and
    where collectives complete in the call (the CPU's, the host-staged CUDA one). Called
    on the rank's main thread; the hooks nest with a collective's own."""
    communicator = _TP.communicator
    if isinstance(communicator, _ObservedCommunicator) and communicator.completes_at_device_sync:
        return communicator.mark
    return _NO_MARK


def destroy_distributed_environment() -> None:
    """Leave the process group and go back to rank 0 of 1. Safe to call more than once,
    and with no group (worker shutdown, tests)."""
    global _TP
    if _TP.communicator is not None:
        _TP.communicator.destroy()
    _TP = TensorParallelGroup(rank=0, world_size=1, communicator=None)
    if dist.is_initialized():
        dist.destroy_process_group()
