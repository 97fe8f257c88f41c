"""CudaCommunicator: TP collectives between GPUs, over NCCL.

Every rank's tensors live on its own device (`torch.cuda.current_device()`, set by the
worker before the group is created); NCCL refuses two ranks of one group on one device
(HostStagedCommunicator is the choice for that). The collectives are the base class's
torch.distributed ones; a custom all-reduce for small messages would override them here.
An NCCL collective is queued on the current stream and returns at once: the wait for the
peers happens at the host's next sync with the device (`completes_at_device_sync`).
"""

from __future__ import annotations

from distributed.device_communicators.base import DeviceCommunicatorBase


class CudaCommunicator(DeviceCommunicatorBase):
    dist_backend = "nccl"
    completes_at_device_sync = True
