"""The serving process's sockets and signals (vLLM's `entrypoints/launcher.py`): the
listening socket, bound before the model loads; SIGINT/SIGTERM handling across start-up
and serving; and the uvicorn run that stops when the engine dies.

Called by engine/entrypoints/cli.py `main`, on the main thread of the server's process
(signal handlers can only be installed there). uvicorn is not imported here: `main`
builds the server after start-up and hands it in.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType
from typing import Any

logger = logging.getLogger("engine.serve")  # the command's name, as in its other log lines


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (before the model loads) so that a port
    in use fails at once; uvicorn listens on it later. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn does: a port whose old connections linger in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class ShutdownSignals:
    """SIGINT/SIGTERM: during start-up they abort it (KeyboardInterrupt); while uvicorn
    serves, its own handlers stop the server and re-raise the signal afterwards, which
    lands here and is only noted, so shutdown continues and the exit code stays 0.
    Constructing it installs the handlers (main thread only); `received` is the last
    signal's number, `serving` is set by `main` once uvicorn is about to take over."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        self.received = signum
        if first and not self.serving:
            raise KeyboardInterrupt


async def serve_http(server: Any, engine: Any, signals: ShutdownSignals, banner: str, sock: socket.socket) -> int:
    """Run the uvicorn `server` on `sock` until it stops (vLLM's `launcher.serve_http`):
    print `banner` once it listens, and stop it when `engine` (an AsyncEngine) dies.
    Runs on the main thread's event loop. Returns the exit code: 1 when the engine died
    while serving, 0 when the server stopped otherwise (a signal, or a worker that died
    during a stop already under way). Raises what uvicorn raises (SystemExit when it
    cannot listen)."""
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    announced = died = stopping_anyway = False
    while not task.done():
        if server.started and not announced:
            announced = True
            print(banner, flush=True)
            if signals.received is not None:  # arrived before uvicorn took the signals over
                server.should_exit = True
        if engine.errored and not died:
            died = True
            if server.should_exit:
                # A stop was already under way: typically the signal went to the whole
                # process group (systemd, `kill -- -PGID`) and took the workers too.
                logger.warning("a worker died while the server was stopping: %s", engine.dead_error)
                stopping_anyway = True
            else:
                logger.error("the engine is dead (%s); shutting the server down", engine.dead_error)
                server.should_exit = True
        await asyncio.wait({task}, timeout=0.1)
    task.result()
    return 1 if died and not stopping_anyway else 0
