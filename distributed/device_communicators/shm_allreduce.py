"""ShmAllReduce: all-reduce and all-gather between the CPU ranks of one host, through one
shared-memory segment.

Why our own: gloo moves even a few KiB between two local processes through its TCP
transport (about 300 µs for 96 KiB and 1.5 ms for 3 KiB here), and a decode step makes
two all-reduces per layer. vLLM (csrc/cpu/shm.cpp), DeepSpeed and SGLang each ship a
shared-memory all-reduce in C++. Here a float32 or bfloat16 all-reduce round runs in one
call of a small C kernel (`shm_allreduce.c`, built on first use like the model's CPU
kernels: distributed/native_build.py), 4-5x faster than the same round in torch ops on
the mapped segment (about 20 µs for a decode step's [32, 768] bfloat16). An all-gather
round is one call too, whatever the dtype: it copies every rank's slot straight into
the gathered layout. The torch ops remain the path for a float16 all-reduce, for an
all-gather whose rows do not fit a slot, and wherever the kernel cannot be built on
some rank or `TP_CPU_SHM_ALLREDUCE_KERNEL=0` (the ranks agree on one path at start).

Layout: a header with one arrival counter and one pid per rank (each on its own cache
line), then per rank two slots of `slot_bytes` (double-buffered by round parity).

Protocol, one round per collective call (or per chunk of a large one), `seq`
counting rounds from 1 on every rank alike:

    rank r:  copy its input into slot[r][seq % 2]                        fence
             arrive[r] = seq
             wait until arrive[j] >= seq for every j                      fence
             read every slot[j][seq % 2] in rank order 0..W-1 (sum or concatenate)

Round seq + 2 reuses slot[r][seq % 2]; by then every rank has arrived at seq + 1, which
it does only after its reads of round seq, so no slot is overwritten while read.
Every rank adds the same slots in the same order, in float32, rounding a half-precision
result once to nearest even, so the result is bit-identical on every rank (and between
the two paths).

`all_reduce_rms_norm` runs a round and then, in the same kernel call, the RMSNorm (with
the residual add) of the summed rows: a decode step's all-reduces each feed a norm, and
between two pinned processes the all-reduce and the norm took about 40 µs a call at
[32, 768] bfloat16 where the fused call takes 29 (the same bits).

While waiting, a rank spins, then yields, then sleeps 50 µs at a time, and every 1000
sleeps (about 0.1 s) checks that its peers' processes are alive: a dead peer is a
`RuntimeError` naming its rank and pid, not a hang; so is a wait past `timeout_s` (the
process group's timeout). The segment's name is unlinked as soon as every rank has
mapped it, so no crash can leave it behind.

Created by `CpuCommunicator` on every rank of the group together (it calls gloo
collectives to agree on the name); each call must be made by every rank in the same
order with tensors of the same shape and dtype.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import time
import uuid
from multiprocessing import shared_memory
from pathlib import Path
from typing import Callable, NamedTuple, TypeVar

import numpy as np
import psutil
import torch
import torch.distributed as dist

from distributed.native_build import BF16_CONVERT_H, NativeLibrary, load_kernel
from distributed.shm_utils import attach_shm, memory_fence

# dtypes the fast path covers; anything else goes to gloo.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_SLOT_BYTES = 4 << 20
_LINE = 8  # int64 entries per 64-byte cache line
_SPINS = 2000
_YIELDS = 20000
_SLEEP_S = 50e-6
_LIVENESS_SLEEPS = 1000  # liveness is checked every this many sleeps (>= 50 ms)
KERNEL_SOURCE = Path(__file__).with_name("shm_allreduce.c")
KERNEL_COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC")
_KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The kernel's own spin (a pause each) before it hands the wait back to _backoff, and
# its spin on each later call.
_KERNEL_SPINS = 4096
_KERNEL_RESPINS = 64

T = TypeVar("T")


class ShmAllReduce:
    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float | None = None) -> None:
        """Every rank of `group` calls this together. Raises OSError when the segment
        cannot be created or mapped on some rank (the caller then keeps gloo)."""
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._sleeping_since = 0.0  # when the current wait began to sleep
        header_bytes = 2 * world_size * _LINE * 8
        self._slots_offset = header_bytes
        size = header_bytes + world_size * 2 * slot_bytes
        names = [f"tp-allreduce-{uuid.uuid4().hex[:16]}" if rank == 0 else ""]
        dist.broadcast_object_list(names, src=0, group=group)
        self._mm: mmap.mmap | None = None
        owner: shared_memory.SharedMemory | None = None
        try:
            if rank == 0:
                # Registered with the resource tracker until unlinked below: a SIGKILL
                # before then still removes it.
                owner = self._agree(group, lambda: shared_memory.SharedMemory(name=names[0], create=True, size=size))
            else:
                self._agree(group, lambda: None)
            self._mm = self._agree(group, lambda: attach_shm(names[0], size))
        finally:
            if owner is not None:  # every rank has mapped it, or given up
                owner.unlink()
                owner.close()
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        counters = np.frombuffer(self._mm, dtype=np.int64, count=2 * world_size * _LINE)
        self._arrive = counters[: world_size * _LINE : _LINE]
        self._pids = counters[world_size * _LINE :: _LINE]
        self._pids[rank] = os.getpid()
        self._seq = 0
        self._slot_views: dict[torch.dtype, list[torch.Tensor]] = {}
        self._acc: torch.Tensor | None = None  # float32 sums of half-precision chunks, world_size > 2
        dist.barrier(group=group)  # every pid is written before anyone may need it
        self._peers = [j for j in range(world_size) if j != rank]
        self._kernel = self._agree_on_kernel(group, counters)

    def _agree_on_kernel(self, group: dist.ProcessGroup, counters: np.ndarray) -> AllReduceKernel | None:
        """The C round, if every rank loaded it (the paths must not mix: each rank would
        still get the same sum, but one path for all is what the tests pin down)."""
        kernel = load_all_reduce_kernel()
        loaded = [False] * self.world_size
        dist.all_gather_object(loaded, kernel is not None, group=group)
        if kernel is None or not all(loaded):
            return None
        base = self._bytes.data_ptr() + self._slots_offset
        # Kept as attributes: _group holds their addresses, not references.
        self._slot_ptrs = [(ctypes.c_void_p * self.world_size)(
            *(base + (j * 2 + phase) * self.slot_bytes for j in range(self.world_size))) for phase in (0, 1)]
        self._group = _ShmGroup(ctypes.addressof(self._slot_ptrs[0]), ctypes.addressof(self._slot_ptrs[1]),
                                counters.ctypes.data, _LINE, self.world_size, self.rank)
        self._group_ptr = ctypes.addressof(self._group)
        return kernel

    def _agree(self, group: dist.ProcessGroup, step: Callable[[], T]) -> T:
        """Run `step` on every rank; if it raised OSError on any, raise on all (every
        rank makes the same collective calls either way)."""
        result: T | None = None
        error = ""
        try:
            result = step()
        except OSError as e:
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        errors = [""] * self.world_size
        dist.all_gather_object(errors, error, group=group)
        if any(errors):
            if isinstance(result, mmap.mmap):
                result.close()
            raise OSError("; ".join(e for e in errors if e))
        return result  # type: ignore[return-value]

    @property
    def uses_kernel(self) -> bool:
        """Whether float32 and bfloat16 rounds run in the C kernel (on every rank alike)."""
        return self._kernel is not None

    def supports(self, x: torch.Tensor) -> bool:
        return x.dtype in SUPPORTED_DTYPES and x.device.type == "cpu"

    def _slot(self, rank: int, phase: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        views = self._slot_views.get(dtype)
        if views is None:  # whole-slot views, built once per dtype: a call only slices
            views = self._slot_views[dtype] = [
                self._bytes[start : start + self.slot_bytes].view(dtype)
                for start in (self._slots_offset + i * self.slot_bytes for i in range(2 * self.world_size))
            ]
        return views[rank * 2 + phase][:numel]

    def _round(self, x: torch.Tensor) -> int:
        """Publish flat `x` (fits a slot) in this rank's slot; return once every rank has."""
        self._seq += 1
        phase = self._seq & 1
        self._slot(self.rank, phase, x.dtype, x.numel()).copy_(x)
        memory_fence()
        self._arrive[self.rank] = self._seq
        self._wait_for_peers(self._seq)
        memory_fence()
        return phase

    def _wait_for_peers(self, seq: int) -> None:
        arrive = self._arrive
        spins = 0
        for peer in self._peers:
            while arrive[peer] < seq:
                spins = self._backoff(spins, seq)

    def _backoff(self, spins: int, seq: int) -> int:
        """One wait step: spin, then yield the core, then sleep, checking liveness."""
        spins += 1
        if spins < _SPINS:
            return spins
        if spins < _YIELDS:
            os.sched_yield()
            return spins
        if spins == _YIELDS:
            self._sleeping_since = time.monotonic()
        time.sleep(_SLEEP_S)
        if spins % _LIVENESS_SLEEPS == 0:
            self._check_peers_alive(seq)
        return spins

    def _check_peers_alive(self, seq: int) -> None:
        for j in self._peers:
            if self._arrive[j] >= seq:
                continue
            pid = int(self._pids[j])
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                raise RuntimeError(f"TP rank {j} (pid {pid}) died while rank {self.rank} waited for it in a "
                                   "shared-memory collective")
        if self.timeout_s is not None and time.monotonic() - self._sleeping_since > self.timeout_s:
            late = [j for j in self._peers if self._arrive[j] < seq]
            raise RuntimeError(f"rank {self.rank} waited over {self.timeout_s:g} s for TP rank(s) {late} in a "
                               "shared-memory collective (the process group's timeout)")

    def _kernel_round(self, fn: Callable[..., int], head: tuple, tail: tuple = ()) -> None:
        """One round of a C entry, called as fn(group, *head, seq, published, max_spins,
        *tail): it spins, then hands the wait back here (status 1), and is called again
        until the round is done."""
        self._seq += 1
        seq = self._seq
        status = fn(self._group_ptr, *head, seq, 0, _KERNEL_SPINS, *tail)
        spins = _SPINS  # the kernel spun; from here on the wait yields, then sleeps
        while status == 1:
            spins = self._backoff(spins, seq)
            status = fn(self._group_ptr, *head, seq, 1, _KERNEL_RESPINS, *tail)
        if status == 3:
            raise MemoryError("the RMSNorm after the shared-memory all-reduce could not allocate its scratch row")
        if status:
            raise RuntimeError(f"the shared-memory collective kernel returned {status} for {fn.__name__}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (chunked through the slots); returns `x`."""
        kernel_dtype = _KERNEL_DTYPES.get(x.dtype) if self._kernel is not None else None
        if kernel_dtype is not None:
            size = x.element_size()
            if x.is_contiguous() and x.numel() * size <= self.slot_bytes:  # a decode step's: one round
                self._kernel_round(self._kernel.round, (x.data_ptr(), x.numel() * size, x.numel(), kernel_dtype))
                return x
            flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
            chunk = self.slot_bytes // size
            for start in range(0, flat.numel(), chunk):
                count = min(chunk, flat.numel() - start)
                ptr = flat.data_ptr() + start * size
                self._kernel_round(self._kernel.round, (ptr, count * size, count, kernel_dtype))
            if flat.data_ptr() != x.data_ptr():
                x.copy_(flat.view_as(x))
            return x
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        chunk = self.slot_bytes // x.element_size()
        # Two half-precision slots are added in one op: torch adds them in float32 and
        # rounds once, exactly what accumulating in float32 gives. More need a float32
        # accumulator, which is kept between calls (a fresh one per call was 6.7 ms of
        # page faults and copies for a 3 MB bfloat16 prefill all-reduce here).
        accumulate = x.dtype != torch.float32 and self.world_size > 2
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            phase = self._round(part)
            slots = [self._slot(j, phase, x.dtype, part.numel()) for j in range(self.world_size)]
            if not accumulate:
                torch.add(slots[0], slots[1], out=part)
                for slot in slots[2:]:
                    part.add_(slot)
            else:
                total = self._accumulator(part.numel())
                total.copy_(slots[0])
                for slot in slots[1:]:
                    total.add_(slot)
                part.copy_(total)
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float, norm_kernel: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sum x [T, n] over the ranks, add `residual` into it in place (when given), and
        return (RMSNorm of the sum with `weight`, x): `all_reduce(x)` followed by the norm
        kernel at address `norm_kernel` (cpu_ops.c's `cpu_rms_norm`), in one kernel call per
        round (rows that fit a slot). None, with nothing sent or touched, for what the C
        round does not take (no kernel, a dtype other than float32/bfloat16, a tensor that
        is not 2-D and contiguous, a weight or residual that does not match x): the caller
        then all-reduces and norms on its own. Every rank must get None alike, which holds
        since the ranks pass tensors of one dtype, shape and layout. Raises MemoryError when
        the norm cannot allocate its scratch row."""
        kernel = self._kernel
        dtype = _KERNEL_DTYPES.get(x.dtype) if kernel is not None else None
        if (dtype is None or x.dim() != 2 or not x.is_contiguous() or x.shape[1] * x.element_size() > self.slot_bytes
                or weight.dtype != x.dtype or not weight.is_contiguous() or weight.numel() != x.shape[1]
                or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape
                                              or not residual.is_contiguous()))):
            return None
        rows, n = x.shape
        out = torch.empty_like(x)
        row_bytes = n * x.element_size()
        chunk = self.slot_bytes // row_bytes
        threads = torch.get_num_threads()
        for start in range(0, rows, chunk):
            count = min(chunk, rows - start)
            offset = start * row_bytes
            args = (x.data_ptr() + offset, count, n, dtype)
            tail = (norm_kernel, None if residual is None else residual.data_ptr() + offset, weight.data_ptr(),
                    out.data_ptr() + offset, eps, threads)
            self._kernel_round(kernel.norm_round, args, tail)
        return out, x

    def _accumulator(self, numel: int) -> torch.Tensor:
        """A float32 buffer of `numel` elements (at most one slot's worth), reused."""
        if self._acc is None or self._acc.numel() < numel:
            self._acc = torch.empty(self.slot_bytes // 2, dtype=torch.float32)
        return self._acc[:numel]

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order. With the kernel, x is
        `outer` rows (the dimensions before `dim`) of what follows, and each round carries
        the rows that fit a slot and copies every rank's straight into its place in the
        result; otherwise chunks go through the slots into a [world, numel] buffer, which
        is then laid out along `dim`."""
        x = x.contiguous()
        dim = dim % x.dim()
        row_bytes = math.prod(x.shape[dim:]) * x.element_size()
        if self._kernel is not None and 0 < row_bytes <= self.slot_bytes:
            outer = math.prod(x.shape[:dim])
            shape = list(x.shape)
            shape[dim] *= self.world_size
            out = torch.empty(shape, dtype=x.dtype)
            rows_per_round = self.slot_bytes // row_bytes
            for start in range(0, outer, rows_per_round):
                count = min(rows_per_round, outer - start)
                self._kernel_round(self._kernel.gather_round, (x.data_ptr() + start * row_bytes, count, row_bytes),
                                   (out.data_ptr() + start * self.world_size * row_bytes,))
            return out
        flat = x.view(-1)
        chunk = self.slot_bytes // x.element_size()
        gathered = torch.empty((self.world_size, flat.numel()), dtype=x.dtype)
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            phase = self._round(part)
            for j in range(self.world_size):
                gathered[j, start : start + part.numel()].copy_(self._slot(j, phase, x.dtype, part.numel()))
        # [world, ..., d, ...] -> [..., world, d, ...] -> [..., world * d, ...]
        out = gathered.view(self.world_size, *x.shape).movedim(0, dim)
        return out.reshape(*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1 :])

    def close(self) -> None:
        """Drop this process's mapping (the name is long gone)."""
        if self._mm is not None:
            self._slot_views.clear()
            del self._bytes, self._arrive, self._pids
            try:
                self._mm.close()
            except BufferError:  # a tensor view still alive; the mapping goes with the process
                pass
            self._mm = None


class _ShmGroup(ctypes.Structure):
    """shm_allreduce.c's `shm_group`: a communicator's slots and counters."""

    _fields_ = [("slots0", ctypes.c_void_p), ("slots1", ctypes.c_void_p), ("arrive", ctypes.c_void_p),
                ("stride", ctypes.c_int64), ("world", ctypes.c_int32), ("rank", ctypes.c_int32)]


class AllReduceKernel(NamedTuple):
    """shm_allreduce.c's entries: `round` (shm_allreduce_round), `norm_round`
    (shm_allreduce_norm_round) and `gather_round` (shm_allgather_round)."""

    round: Callable[..., int]
    norm_round: Callable[..., int]
    gather_round: Callable[..., int]


def load_all_reduce_kernel() -> AllReduceKernel | None:
    """The C rounds, built or loaded for this CPU; None where not (logged) or TP_CPU_SHM_ALLREDUCE_KERNEL=0."""

    def wrap(lib: NativeLibrary, path: Path) -> AllReduceKernel:
        i64, i32, p, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        round_fn, norm_fn, gather_fn = lib.shm_allreduce_round, lib.shm_allreduce_norm_round, lib.shm_allgather_round
        round_fn.argtypes = [p, p, i64, i64, i32, i64, i32, i64]
        norm_fn.argtypes = [p, p, i64, i64, i32, i64, i32, i64, p, p, p, p, f32, i32]
        gather_fn.argtypes = [p, p, i64, i64, i64, i32, i64, p]
        round_fn.restype = norm_fn.restype = gather_fn.restype = i32
        return AllReduceKernel(round_fn, norm_fn, gather_fn)

    return load_kernel((KERNEL_SOURCE, BF16_CONVERT_H), KERNEL_COMPILE_FLAGS, ("-shared",), (), wrap,
                       "the shared-memory all-reduce kernel is unavailable (%s); its torch-op path runs instead",
                       switch="TP_CPU_SHM_ALLREDUCE_KERNEL")
