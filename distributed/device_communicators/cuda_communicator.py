"""CudaCommunicator: TP collectives between GPUs, over NCCL.

Every rank's tensors live on its own device (`torch.cuda.current_device()`, set by the
worker before the group is created). The collectives are the base class's
torch.distributed ones; a custom all-reduce for small messages would override them here.
"""

from __future__ import annotations

from distributed.device_communicators.base import DeviceCommunicatorBase


class CudaCommunicator(DeviceCommunicatorBase):
    dist_backend = "nccl"
