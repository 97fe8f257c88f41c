"""Device communicators: how one platform's ranks run the TP collectives.

`get_device_communicator_cls(device_type)` picks the class: NCCL on CUDA, gloo on the
CPU. A faster path for one platform (a shared-memory all-reduce for ranks on one host)
is another class here; the models never see which one runs.
"""

from __future__ import annotations

from distributed.device_communicators.base import DeviceCommunicatorBase


def get_device_communicator_cls(device_type: str) -> type[DeviceCommunicatorBase]:
    """The communicator for a worker on `device_type` ("cuda" | "cpu"); ValueError otherwise."""
    if device_type == "cuda":
        from distributed.device_communicators.cuda_communicator import CudaCommunicator

        return CudaCommunicator
    if device_type == "cpu":
        from distributed.device_communicators.cpu_communicator import CpuCommunicator

        return CpuCommunicator
    raise ValueError(f"no device communicator for device type {device_type!r}; supported: 'cuda', 'cpu'")


__all__ = ["DeviceCommunicatorBase", "get_device_communicator_cls"]
