"""CPU graphs: a forward's operations recorded once, then replayed without its Python.

What CUDA graphs do for a GPU's kernel launches, this does for the CPU's Python. A
decode step of a small model on the CPU spent 3-4 ms (2026-12-05, the 2-core dev VM, a
16-layer Llama in Q4_K_M) in the Python around its kernels (module calls, argument
checks, ctypes conversions), against about 16 ms in the kernels. `record(forward)` runs
`forward()` once under a recorder, which keeps, in order:
- every torch operation (a `TorchDispatchMode` sees each aten op) with its arguments;
- every C kernel call (`distributed/native_calls.py`);
- every collective (`recorded_as_call`: kept whole, its Python run again at each replay,
  since the communicators keep round numbers and waits there).
Views and allocations are not kept. Every storage the forward allocates gets a place in
one arena, two storages sharing bytes only when their lifetimes (first to last op that
touches them) do not overlap; the kept ops are rewritten to read and write the same
views of the arena, and the C calls' pointers into those storages are moved by the same
offsets. `CpuGraph.replay()` runs the rewritten list and nothing else: no module calls,
no argument checks, no allocations. Tensors from outside the forward (weights, the KV
cache, the caller's input buffers) are read as they are at each replay.

What cannot be replayed is refused while recording (`NotCapturable`): an operation that
reads tensor data into Python (`.item()`, `.tolist()`), makes a tensor from Python data
(`torch.tensor`), has a data-dependent output shape (`nonzero`, boolean-mask indexing:
a mixture of experts' routing), or a C call given an array of pointers into the
forward's tensors. A C call whose status differs from the recorded one raises
RuntimeError at replay. Every C call must go through `NativeFunction` (every kernel
loaded by `load_kernel` does); one around it would not be replayed, which
tests/test_cpu_graph.py checks against the eager forward on the CPU's layer paths, at
TP 1 and 2. The decode steps' use of it: `worker/cpu_graph_runner.py`.

Memory: a graph holds the tensors from outside that it read, its arena (the most the
forward's tensors need at once: 34 KiB at 1 token, 0.5 MiB at 16, for that Llama) and
its list of ops (about 180). Its output is a view of the arena, overwritten by the next
replay. Recording imports nothing beyond torch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from distributed.native_calls import paused_recording, recording_native_calls

aten = torch.ops.aten
# Operations whose result depends on tensor data in a way a replay would not redo.
_REFUSED = {aten._local_scalar_dense.default, aten.lift_fresh.default, aten.lift_fresh_copy.default,
            aten.equal.default, aten.is_nonzero.default}
_DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
# Operations that only allocate: their outputs' contents are undefined, so a replay
# needs nothing from them but the memory, which the graph holds.
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default}
_ALIGN = 64  # bytes: every value's storage starts on a cache line of the arena


class NotCapturable(RuntimeError):
    """The forward did something a replay cannot repeat (named in the message)."""


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of t's storage; (0, 0) for a tensor without one (an opaque
    oneDNN packed weight: never a value of the step)."""
    try:
        storage = t.untyped_storage()
    except NotImplementedError:
        return 0, 0
    return storage.data_ptr(), storage.nbytes()


def _integer_indexing(func: Any, args: tuple[Any, ...]) -> bool:
    """`x[indices]` with integer index tensors: its output's shape is the indices', so
    it replays (the op is tagged data-dependent for the boolean masks it also takes)."""
    return func is aten.index.Tensor and all(
        i is None or (isinstance(i, torch.Tensor) and not i.is_floating_point() and i.dtype not in (torch.bool, torch.uint8))
        for i in args[1])


def _pointer_args(fn: Any, args: tuple[Any, ...]) -> list[int]:
    """The positions of a C call's non-null pointer arguments (`c_void_p` in its
    argtypes, passed as an int)."""
    argtypes = fn.argtypes or ()
    return [i for i, (arg, argtype) in enumerate(zip(args, argtypes))
            if argtype is ctypes.c_void_p and isinstance(arg, int) and arg]


class _Storage:
    """One storage the step allocated: its size, the op that made it and the last op
    that reads or writes it (where its bytes in the arena may be reused after)."""

    __slots__ = ("nbytes", "first", "last", "offset")

    def __init__(self, nbytes: int, first: int) -> None:
        self.nbytes, self.first, self.last, self.offset = nbytes, first, first, 0


class _Recorder(TorchDispatchMode):
    """Runs one forward as usual while keeping its operations (module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's handler in torch._dynamo.disable unless told not to: that
        # imports dynamo, fx and sympy (about 150 MiB resident) for a mode that never
        # meets torch.compile.
        return False

    def __init__(self) -> None:
        super().__init__()
        # (op, args, kwargs, outs) for a torch op, (fn, args, status) for a C call.
        self.ops: list[tuple[Any, ...]] = []
        self.values: dict[int, torch.Tensor] = {}  # id -> each tensor the step made (alive until the end)
        self.storages: dict[int, _Storage] = {}  # storage address -> what the step allocated there
        self.extents: list[tuple[int, int]] = []  # (first byte, end) of each such storage

    def _owner(self, t: torch.Tensor) -> int | None:
        """The address of the step's storage `t` lives in, or None for a tensor from
        outside the step (a weight, the cache, a buffer)."""
        key = _storage(t)[0]
        return key if id(t) in self.values and key in self.storages else None

    def _use(self, key: int) -> None:
        self.storages[key].last = len(self.ops)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _REFUSED or (any(tag in func.tags for tag in _DATA_DEPENDENT_TAGS)
                                and not _integer_indexing(func, args)):
            raise NotCapturable(f"{func} reads tensor data into Python or has a data-dependent shape")
        out = func(*args, **kwargs)
        replayed = self._track(func, args, kwargs, out, func._schema.is_mutable)
        if replayed and func not in _ALLOCATIONS:
            self.ops.append((func, args, kwargs, out))
        return out

    def call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The hook for `recorded_as_call` functions: run `fn` unrecorded, keep the call."""
        with _disable_current_modes(), paused_recording():
            out = fn(*args, **kwargs)
        self._track(fn, args, kwargs, out, True)
        self.ops.append((_WholeCall(fn), args, kwargs, out))
        return out

    def _track(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, writes: bool) -> bool:
        """Note the step's storages `func` read and made; False for a view or alias (of
        the step's tensors: one of them; of tensors from outside: the same view at every
        replay), which a replay need not run."""
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        for x in inputs:
            key = self._owner(x)
            if key is not None:
                self._use(key)
        input_storages = {_storage(x)[0] for x in inputs}
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        fresh = [t for t in outs if _storage(t)[0] not in input_storages]
        if not fresh and not writes:
            if any(id(x) in self.values for x in inputs):
                for t in outs:
                    self.values[id(t)] = t
            return False
        for t in fresh:
            key, nbytes = _storage(t)
            if not key and t.numel():
                raise NotCapturable(f"{func} made a tensor without a storage ({t.layout})")
            if nbytes and key not in self.storages:
                self.storages[key] = _Storage(nbytes, len(self.ops))
                self.extents.append((key, key + nbytes))
            self.values[id(t)] = t
        for t in outs:
            if id(t) not in self.values and any(id(x) in self.values for x in inputs):
                self.values[id(t)] = t  # an alias of one of the step's tensors, returned by a call
        return True

    def native(self, fn: Any, args: tuple[Any, ...]) -> Any:
        """The hook for `recording_native_calls`: run the C call, keep it."""
        status = fn(*args)
        for i in _pointer_args(fn, args):
            start = self._extent(args[i])
            if start is not None:
                self._use(start)
        if any(isinstance(arg, ctypes.Array) and any(isinstance(p, int) and self._extent(p) is not None for p in arg)
               for arg in args):
            raise NotCapturable(f"{fn.__name__} takes an array of pointers into the step's tensors")
        self.ops.append((fn, args, status))
        return status

    def _extent(self, address: int) -> int | None:
        """The first byte of the step's storage holding `address`, or None."""
        for start, end in self.extents:
            if start <= address < end:
                return start
        return None

    def finish(self, out: torch.Tensor) -> CpuGraph:
        """The graph: every storage the step made given a place in one arena (two share
        bytes only when no op lies between their first and last use), every recorded
        tensor of the step re-made as the same view of its place, and the ops rewritten
        to read and write those (C calls' pointers moved by the same offsets)."""
        key = self._owner(out)
        if key is None:
            raise NotCapturable("the forward returned a tensor it did not make")
        self.storages[key].last = len(self.ops)  # the output outlives the replay
        size = _plan(self.storages)
        arena = torch.empty(size, dtype=torch.uint8)
        static: dict[int, torch.Tensor] = {}

        def remap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or self._owner(x) is None:
                return x
            if id(x) not in static:
                key, nbytes = _storage(x)
                place = self.storages[key].offset
                base = arena[place:place + nbytes].view(x.dtype)
                static[id(x)] = base.as_strided(x.shape, x.stride(), base.storage_offset() + x.storage_offset())
            return static[id(x)]

        steps: list[Any] = []
        for op in self.ops:
            if len(op) == 3:
                fn, args, status = op
                moved = list(args)
                for i in _pointer_args(fn, args):
                    start = self._extent(args[i])
                    if start is not None:
                        moved[i] = arena.data_ptr() + self.storages[start].offset + args[i] - start
                steps.append(_NativeStep(fn, moved, status))
                continue
            func, args, kwargs, result = op
            leaves, spec = tree_flatten((args, kwargs))
            inputs = {_storage(x)[0] for x in leaves if isinstance(x, torch.Tensor)}
            args, kwargs = tree_unflatten([remap(x) for x in leaves], spec)
            if isinstance(func, _WholeCall):
                # Each new tensor it returns is copied into the graph's; aliases need nothing.
                func.targets = [remap(t) if isinstance(t, torch.Tensor) and _storage(t)[0] not in inputs else None
                                for t in tree_flatten(result)[0]]
                steps.append(functools.partial(func, *args, **kwargs))
                continue
            steps.append(_aten_step(func, args, kwargs, [remap(t) for t in tree_flatten(result)[0]
                                                         if isinstance(t, torch.Tensor)]))
        return CpuGraph(steps, arena, remap(out))


def _plan(storages: dict[int, _Storage]) -> int:
    """Offsets for `storages` in one arena (largest first, each at the lowest offset
    that overlaps no storage alive at the same time); returns the arena's size."""
    placed: list[_Storage] = []
    size = 0
    for st in sorted(storages.values(), key=lambda s: -s.nbytes):
        need = -(-st.nbytes // _ALIGN) * _ALIGN
        offset = 0
        for other in sorted((o for o in placed if o.first <= st.last and st.first <= o.last), key=lambda o: o.offset):
            if offset + need <= other.offset:
                break
            offset = max(offset, other.offset + -(-other.nbytes // _ALIGN) * _ALIGN)
        st.offset = offset
        placed.append(st)
        size = max(size, offset + need)
    return size


class _NativeStep:
    __slots__ = ("fn", "args", "status")

    def __init__(self, fn: Any, args: list[Any], status: Any) -> None:
        self.fn, self.args, self.status = fn, args, status

    def __call__(self) -> None:
        status = self.fn(*self.args)
        if status != self.status:
            raise RuntimeError(f"CPU graph replay: {self.fn.__name__} returned {status}, where the captured step's "
                               f"call returned {self.status}")


class _WholeCall:
    """A `recorded_as_call` function at replay: called again, its new outputs copied
    into the graph's tensors (`targets`, in its flattened result's order)."""

    __slots__ = ("fn", "targets")

    def __init__(self, fn: Any) -> None:
        self.fn, self.targets = fn, []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        leaves = tree_flatten(self.fn(*args, **kwargs))[0]
        if len(leaves) != len(self.targets):
            raise RuntimeError(f"CPU graph replay: {self.fn.__name__} returned {len(leaves)} values, where the "
                               f"captured step's call returned {len(self.targets)}")
        for target, got in zip(self.targets, leaves):
            if target is not None:
                target.copy_(got)


def _aten_step(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]) -> Any:
    """A replayable call of `func`: in place as recorded, or writing its new outputs into
    the graph's tensors (through an overload that takes them, as `out=` or, for several,
    as `topk.values`' `values=` and `indices=`; else copies)."""
    if func._schema.is_mutable:
        return functools.partial(func, *args, **kwargs)
    inputs = [(a.name, str(a.type)) for a in func._schema.arguments]
    for name in func.overloadpacket.overloads():  # the overload with func's arguments and one to write each output
        op = getattr(func.overloadpacket, name)
        written = [a.name for a in op._schema.arguments if a.is_out]
        if (outs and len(written) == len(outs)
                and [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out] == inputs):
            return functools.partial(op, *args, **kwargs, **dict(zip(written, outs)))
    if len(outs) > 1:
        return lambda: [target.copy_(got) for target, got in zip(outs, func(*args, **kwargs))]
    if not outs:
        raise NotCapturable(f"{func} makes no tensor the graph could hold")
    target = outs[0]
    if func.overloadpacket is aten.to and isinstance(args[0], torch.Tensor):
        return functools.partial(target.copy_, args[0])  # a conversion: copy_ rounds as .to() does
    return lambda: target.copy_(func(*args, **kwargs))


class CpuGraph:
    """One batch size's recorded forward: its steps, and the arena that holds every
    tensor the step makes (its output included, overwritten by the next replay)."""

    def __init__(self, steps: list[Any], arena: torch.Tensor, out: torch.Tensor) -> None:
        self.steps = steps
        self.arena = arena
        self.out = out

    def replay(self) -> torch.Tensor:
        for step in self.steps:
            step()
        return self.out


def record(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, CpuGraph]:
    """Run `forward()` once, recording it: (its output, the graph that repeats it on
    whatever its tensors from outside hold at replay). Raises NotCapturable (after
    running part of `forward`) for what a replay cannot repeat."""
    recorder = _Recorder()
    with recorder, recording_native_calls(recorder):
        out = forward()
    return out, recorder.finish(out)
