"""Start multiprocessing's forkserver as a fork of the engine process, when that is safe.

Why: the stock forkserver is a fresh interpreter that imports its preload (torch and the
worker stack) before it forks the first rank. That import is 2-3 s on a small host, most
of a cold TP=2 start, while the engine process beside it has imported all of it already.
A fork of the engine process is a forkserver that is warm at once. It then runs the
stock server loop (`multiprocessing.forkserver.main`), so every rank is still a fork of
one single-threaded server that does nothing else, reaped and cleaned up as before
(executor/worker_proc.py); Python's own `fork` start method would instead fork the
engine itself, threads and all, for every rank and every restart.

Who calls: MultiprocExecutor, on the engine's process, before it starts any thread or
socket of its own. Later engines and restarts of the same process reuse the server.

When it is safe, and otherwise: the stock forkserver starts instead (at the first
`Process.start()`), with the same behaviour and the old start-up time. The fork is taken
only when all of these hold:
- the platform is Linux and the engine's device is the CPU (a process that touched
  CUDA must never be forked, and on a GPU host the stock server's cost is small
  beside CUDA's own start);
- this process runs no other Python thread (their locks would be copied held);
- the forkserver preload is imported here already;
- `multiprocessing.forkserver` has the internals this was written against (CPython
  3.11's, checked by the server loop's signature and attributes; a server that
  authenticates its clients, as 3.14's does, is left to start the stock way); and
- a probe child forked from this process can run a parallel torch op. GNU OpenMP keeps
  its thread pool across fork, so a fork of a process that has run a parallel region
  hangs in its next one; the probe finds this out in a few milliseconds and is killed
  after `_PROBE_TIMEOUT_S` if it hangs.

A forked server shares the engine's file descriptors (as vLLM's fork start method
does) and lives until the engine process exits, when it removes the engine's
multiprocessing temp dir, as the stock one does.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import socket
import sys
import threading
import time
import warnings
from multiprocessing import connection, forkserver, resource_tracker

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 1.0
_MAIN_PARAMS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def start_forked_forkserver(preload: list[str], device_type: str) -> bool:
    """Make this process's forkserver a fork of it, if none runs and it is safe (see the
    module docstring). Returns whether the server running now is such a fork made by
    this call; False leaves everything as it was, for the stock server to start later.
    Never raises for an unsafe process: it declines instead."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    reason = _unsafe_reason(server, preload, device_type)
    if reason is not None:
        logger.debug("forkserver: not forked from the engine process (%s)", reason)
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            return False  # started meanwhile
        resource_tracker.ensure_running()  # before the fork: the server and its ranks share it
        if not _probe_parallel_region():
            logger.info("forkserver: this process has run OpenMP threads, which a fork cannot use; "
                        "the ranks fork from a fresh forkserver instead (slower to start)")
            return False
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            engine_pid = os.getpid()
            try:
                pid = _fork()
            except OSError as e:
                os.close(alive_r)
                os.close(alive_w)
                logger.info("forkserver: cannot fork the engine process (%s); starting a fresh one", e)
                return False
            if pid == 0:
                _serve(listener.fileno(), alive_r, alive_w, engine_pid)  # never returns
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    logger.debug("forkserver: forked from the engine process (pid %d)", pid)
    return True


def _unsafe_reason(server: object, preload: list[str], device_type: str) -> str | None:
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if device_type != "cpu":
        return f"device {device_type!r}"
    missing = [m for m in preload if m not in sys.modules]
    if missing:
        return f"preload not imported: {missing}"
    if (list(inspect.signature(forkserver.main).parameters) != _MAIN_PARAMS
            or hasattr(server, "_forkserver_authkey")
            or not all(hasattr(server, a) for a in ("_lock", "_forkserver_address", "_forkserver_alive_fd"))):
        return "unknown multiprocessing.forkserver internals"
    if getattr(server, "_forkserver_pid", None) is not None:
        return "a forkserver runs already"
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads run"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised"
    return None


def _probe_parallel_region() -> bool:
    """Whether a fork of this process can run an OpenMP parallel region (see the module
    docstring). The probe child is SIGKILLed if it hangs."""
    import torch

    pid = _fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(2)
            torch.ones(1 << 17).add_(1)  # past ATen's grain size: one parallel region
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + _PROBE_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _fork() -> int:
    """os.fork, with Python's buffered output flushed first (or a child would write it
    again). CPython 3.12+ warns on a fork of a process with other OS threads; the only
    ones left here are the BLAS pools that survive a fork (the probe checks OpenMP's)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _serve(listener_fd: int, alive_r: int, alive_w: int, engine_pid: int) -> None:
    """The forked child: become the forkserver. Exits through os._exit only, so none of
    the engine's atexit handlers or finalizers run here."""
    from executor.worker_proc import remove_engine_temp_dir

    code = 0
    try:
        os.close(alive_w)  # the engine's end: its exit must reach us as EOF
        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.SIG_DFL)  # the engine's handlers are not ours
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # A SIGTERM to the whole process group must leave us the moment to clean up.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        pass  # the stock server's way out: every engine end of the alive pipe is closed
    except BaseException:
        code = 1
    finally:
        try:
            remove_engine_temp_dir(os.getpid(), engine_pid)
        finally:
            os._exit(code)
