"""Device communicators: how one platform's ranks run the TP collectives.

`get_device_communicator_cls(device_type, tp_communicator)` picks the class from the
worker's device and the resolved `ParallelConfig.tp_communicator`: NCCL on CUDA (one
device per rank), gloo staged through host memory on CUDA (ranks may share a device),
gloo with the shared-memory fast path on the CPU. The models never see which one runs.
"""

from __future__ import annotations

from distributed.device_communicators.base import DeviceCommunicatorBase


def get_device_communicator_cls(device_type: str, tp_communicator: str = "auto") -> type[DeviceCommunicatorBase]:
    """The communicator for a worker on `device_type` ("cuda" | "cpu") under
    `tp_communicator` ("nccl" | "gloo", or "auto" for the device's default: NCCL on
    CUDA, gloo on the CPU):

        cuda + nccl -> CudaCommunicator        one device per rank
        cuda + gloo -> HostStagedCommunicator  collectives staged through host memory
        cpu  + gloo -> CpuCommunicator         shared memory on one host, gloo across hosts

    Every rank of a group must get the same class (the resolution step gives every rank
    the same config). ValueError for NCCL on the CPU and for unknown names."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"no device communicator for device type {device_type!r}; supported: 'cuda', 'cpu'")
    choice = tp_communicator
    if choice == "auto":
        choice = "nccl" if device_type == "cuda" else "gloo"
    if choice == "nccl" and device_type == "cuda":
        from distributed.device_communicators.cuda_communicator import CudaCommunicator

        return CudaCommunicator
    if choice == "gloo" and device_type == "cuda":
        from distributed.device_communicators.host_staged_communicator import HostStagedCommunicator

        return HostStagedCommunicator
    if choice == "gloo":
        from distributed.device_communicators.cpu_communicator import CpuCommunicator

        return CpuCommunicator
    if choice == "nccl":
        raise ValueError("tp_communicator='nccl' needs CUDA tensors; a CPU worker uses 'gloo'")
    raise ValueError(f"unknown tp_communicator {tp_communicator!r}; valid: 'auto', 'nccl', 'gloo'")


__all__ = ["DeviceCommunicatorBase", "get_device_communicator_cls"]
