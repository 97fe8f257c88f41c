"""HostStagedCommunicator: TP collectives for ranks that may share one GPU, staged through
host memory (`tp_communicator="gloo"` on CUDA).

NCCL refuses two ranks of one group on one device, so a machine with fewer GPUs than
ranks (a test host, a single-GPU CI runner) cannot run TP > 1 over it. Here each
collective copies its device tensor to host memory, runs the CPU communicator's
collective on that copy (the shared-memory all-reduce and all-gather between the ranks
of one host, gloo across hosts or for other dtypes: `CpuCommunicator`, inherited, not
rewritten) and copies the result back into the device tensor. It is for correctness, not
speed: each call syncs the host with the stream and copies both ways.

The copy to the host is synchronous (it waits for the stream to produce the tensor), so
when a call returns its collective is complete: a rank's wait for its peers happens
inside the call, where the liveness hooks see it (`completes_at_device_sync` stays False).
A host sync cannot be captured in a CUDA graph, so a call during capture raises
RuntimeError (the resolution step turns graphs off for this communicator at TP > 1).

CPU tensors take the same path, the staging copies being host-to-host: that is how the
tests exercise it without a GPU. Created on every rank together, like CpuCommunicator
(its setup runs gloo collectives); every rank must call each collective in the same
order with tensors of the same shape and dtype. Memory: one host copy of the tensor per
call (and, for an all-gather, the gathered host tensor), freed when the call returns.
"""

from __future__ import annotations

import torch

from distributed.device_communicators.cpu_communicator import CpuCommunicator


class HostStagedCommunicator(CpuCommunicator):
    dist_backend = "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group into `x` itself (any device); returns `x`."""
        host = self._stage(x)
        super().all_reduce(host)
        x.copy_(host)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order: a new tensor on x's device."""
        return super().all_gather(self._stage(x), dim).to(x.device)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, norm_kernel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None, with nothing sent: the norm belongs on the tensor's device, after the
        staged all-reduce (the caller's unfused path)."""
        return None

    @staticmethod
    def _stage(x: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of `x`, made once the stream has produced it."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "tp_communicator='gloo' on CUDA stages each collective through host memory, which a CUDA graph "
                "cannot capture; run with enforce_eager=True or tp_communicator='nccl'"
            )
        return x.to("cpu", memory_format=torch.contiguous_format, copy=True)
