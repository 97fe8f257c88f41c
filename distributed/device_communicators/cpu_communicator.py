"""CpuCommunicator: TP collectives between CPU ranks, over gloo.

gloo's all-reduce is correct everywhere, across hosts included, but slow between
processes of one host (about 300 µs for 96 KiB here); a shared-memory fast path for
that case belongs in this class, with gloo kept as the fallback.
"""

from __future__ import annotations

from distributed.device_communicators.base import DeviceCommunicatorBase


class CpuCommunicator(DeviceCommunicatorBase):
    dist_backend = "gloo"
