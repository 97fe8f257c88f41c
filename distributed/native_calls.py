"""The C kernels' entry points as objects a CPU graph can record.

`load_kernel` (native_build.py) hands each kernel's wrapper class a `NativeLibrary`:
`lib.name` is a `NativeFunction` around the ctypes function of that name (its
`restype` and `argtypes` are the ctypes function's own). A call runs the C function,
unless a recorder is installed (`recording_native_calls`): then the recorder runs it
and keeps the call, which is how `worker/cpu_graph.py` captures a decode step's kernels
to replay them without the Python around them. Outside a capture the cost is one
Python call and one attribute read per C call: 0.3-0.5 µs, against 2.8 µs for the
ctypes call itself (an RMSNorm of one bf16 row, 2026-12-05, the dev VM).

A function whose Python must run at every replay (a collective: its round numbers and
its waits live in Python) is decorated `recorded_as_call`: the recorder keeps the call
itself, with its tensors, and runs it again at each replay; what it does inside is not
recorded.

The recorder is per thread, as torch's own dispatch-mode stack is: set by the thread
that captures, for the length of one forward pass, and cleared after it (also when the
forward raises). A C call another thread makes meanwhile (a background thread of the
worker) runs as it would outside a capture and is not recorded. Every rank's kernels go
through here alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

class _Recording(threading.local):
    #: While a CPU graph records on this thread: the recorder, with `native(ctypes
    #: function, args)` and `call(function, args, kwargs)`, each of which runs the call
    #: and returns its result.
    recorder: Any | None = None


_state = _Recording()


class NativeFunction:
    """One exported C function; callable like the ctypes function it wraps (`fn`)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    restype = property(lambda self: self.fn.restype, lambda self, value: setattr(self.fn, "restype", value))
    argtypes = property(lambda self: self.fn.argtypes, lambda self, value: setattr(self.fn, "argtypes", value))

    def __call__(self, *args: Any) -> Any:
        recorder = _state.recorder
        if recorder is not None:
            return recorder.native(self.fn, args)
        return self.fn(*args)


class NativeLibrary:
    """A loaded library whose functions are `NativeFunction`s (one per name, made on
    first access); `cdll` is the ctypes library itself."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.cdll = cdll
        self._functions: dict[str, NativeFunction] = {}

    def __getattr__(self, name: str) -> NativeFunction:
        if name.startswith("__"):
            raise AttributeError(name)
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = NativeFunction(getattr(self.cdll, name))
        return function


def recorded_as_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: while a CPU graph records, the recorder keeps a call of `fn` whole (its
    own C calls and torch ops unrecorded) and calls it again at every replay."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorder = _state.recorder
        if recorder is None:
            return fn(*args, **kwargs)
        return recorder.call(fn, args, kwargs)

    return wrapper


@contextlib.contextmanager
def recording_native_calls(recorder: Any) -> Iterator[None]:
    """Route every `NativeFunction` call to `recorder.native(fn, args)` and every
    `recorded_as_call` function to `recorder.call(fn, args, kwargs)` (each must run the
    call and return its result) inside the block, on this thread. Not reentrant: raises
    RuntimeError if this thread already has a recorder installed."""
    if _state.recorder is not None:
        raise RuntimeError("native calls are already being recorded")
    _state.recorder = recorder
    try:
        yield
    finally:
        _state.recorder = None


@contextlib.contextmanager
def paused_recording() -> Iterator[None]:
    """Calls inside the block run unrecorded (a `recorded_as_call` function's body)."""
    saved, _state.recorder = _state.recorder, None
    try:
        yield
    finally:
        _state.recorder = saved
