"""The parent-death signal: a process asks Linux to signal it when its parent dies.

Called, in the process that is to die with its parent, by WorkerProc (SIGKILL: the
engine that started it is gone, nothing is left to save), by a torchrun rank (SIGTERM
when torchrun's agent dies: the rank shuts down as at the agent's own SIGTERM), and by
the benchmark scripts as the `preexec_fn` of the servers they start (SIGTERM: the server
stops as under a service manager, its workers with it).

Linux only (prctl's PR_SET_PDEATHSIG); elsewhere it does nothing and the callers' other
means (the workers' death pipe, the scripts' own stop) are all there is. The signal is
sent when the thread that started the process exits, so it must be started from a
thread that lives as long as its parent means to keep it.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int) -> None:
    """Have Linux send this process `signum` when its parent dies, however it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
