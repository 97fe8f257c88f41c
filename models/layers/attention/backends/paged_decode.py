"""Paged decode attention on the CPU: a small C kernel, compiled on first use.

A decode step attends one query token per sequence to that sequence's cached K/V. torch
has no kernel for it on the CPU: the SDPA backend gathers the blocks into a padded
batch and calls the flash kernel, whose tiny per-(sequence, kv head) GEMMs (a GQA
group's 1-8 query rows) spend about 2 ms per layer on 9 MFLOP here, ten times what
reading the K/V costs. vLLM has such kernels in its csrc/cpu, but they come only
with vLLM. `paged_decode.c` reads each sequence's own blocks where they lie in the
paged cache, with no gather, no padding and no mask, and returns the log-sum-exp too
(the cascade merges with it). It knows a sliding window (each query reads only its
window's blocks) and Gemma 2's logit soft cap, so windowed and capped layers keep it.

q, the cache and the output are float32, bfloat16 or float16 (one dtype; every path
computes in float32, 16-bit values widened as they are read: float16 with F16C, as the
CPU's other float16 kernels), so a float16 model's decode steps take it and record as
CPU graphs like a bfloat16 one's: on the Zen 3 VM (2026-12-06) a 100M Llama in float16
had run at 0.62x its bfloat16 throughput, its decode attention in torch's flash kernel.

A prefill chunk is attended by the same kernel, each of its query tokens as a query of
its own against the positions up to it (the backend's `CPUAttentionImpl.forward`):
torch's causal flash kernel took 2-3x as long for prompts of 32-1024 tokens here, and
1.3-1.4x at 2048-8192 against the AVX-512 path (`avx512`). The portable path was level
with flash at 512 tokens and 1.7x slower at 2048. Past the lengths measured the backend
keeps flash (`cpu_attn.PREFILL_KERNEL_MAX_CONTEXT*`).

On a CPU with AVX2 and FMA but no AVX-512, head size 64 takes the AVX2 path (`avx2`,
paged_decode_avx2.h): against the portable loop as the compiler vectorises it for that
CPU, decode attention of 16-32 sequences of 100-1024 positions (bfloat16, 4-8 kv heads
in groups of 4, the K/V read from memory) took 1.3-1.6x less time, one sequence
1.26-1.28x (2026-12-06, the Zen 3 VM, 2 threads); head size 128 stays on the portable
loop, which the same plan only matched (0.85-1.16x). Its prefill keeps the portable
path's limit (512 positions): against flash on one prompt (32 heads, 8 kv heads, bfloat16)
it took 1.37-1.39x less time at 256-512 tokens and lost from 1024 (0.93x; 0.81x at 2048).

The source is compiled for this CPU (`-march=native`) the first time a process needs
it and cached (distributed/native_build.py). When there is no compiler, the build
fails, or `TP_CPU_PAGED_DECODE=0` is set, `load()` returns None and the backend keeps
its torch path: the kernel is a speed-up, never a requirement.

Called by `CPUAttentionBackend` on every rank.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from distributed.native_build import BF16_CONVERT_H, FP16_CONVERT_H, load_kernel
from distributed.native_calls import NativeLibrary

SOURCE = Path(__file__).with_name("paged_decode.c")
# The headers it includes: a change to one rebuilds the library.
SOURCES = (SOURCE, SOURCE.with_name("paged_decode_common.h"), SOURCE.with_name("paged_decode_avx512.h"),
           SOURCE.with_name("paged_decode_avx2.h"), BF16_CONVERT_H, FP16_CONVERT_H)
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# No -ffast-math here: linking with it would add crtfastmath.o, whose constructor turns
# on flush-to-zero for the whole process. libmvec: glibc's vector expf, which the
# vectorised softmax calls.
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBS = ("-lmvec", "-lm")  # after the object, or --as-needed drops them

# One entry point per dtype (paged_decode.c's EXPORTs): q, the cache and the output share it.
_DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16", torch.float16: "paged_decode_f16"}
_INPUT_ERRORS = {
    2: "paged decode: a sequence length is not above start={start}",
    3: "paged decode: a block table entry is outside the cache's {blocks} blocks",
    4: "paged decode: block_tables has {width} columns, too few for a sequence length (block size {block_size})",
}


class PagedDecodeKernel:
    """The loaded library; `__call__` runs it."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path = path
        # Whether head sizes 64 and 128 take the AVX-512 path (compiled for this CPU).
        self.avx512 = bool(lib.paged_decode_avx512())
        # Whether head size 64 takes the AVX2 path instead (an AVX2 and FMA CPU without AVX-512).
        self.avx2 = bool(lib.paged_decode_avx2())
        self._fns = {}
        for dtype, name in _DTYPES.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p] + [ctypes.c_int64] * 5
                           + [ctypes.c_float, ctypes.c_int64, ctypes.c_float, ctypes.c_int])
            self._fns[dtype] = fn
        self._write_kv = lib.paged_write_kv
        self._write_kv.restype = ctypes.c_int
        self._write_kv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """k, v [T, Hkv, D] (each token's heads contiguous; rows at any stride) into their
        slots of kv_cache [num_blocks, 2, block_size, Hkv, D] (contiguous, k's dtype) at
        slot_mapping [T] (int64, block * block_size + offset): what the backend's index
        assignment does, in one pass instead of two index_put ops (7 against 13 µs a layer
        at a decode step's 32 tokens, mostly this check). False, with nothing written, for
        tensors it does not take; IndexError for a slot outside the cache, before anything
        is written."""
        if not (k.device.type == v.device.type == kv_cache.device.type == "cpu" and k.dtype == v.dtype == kv_cache.dtype
                and k.shape == v.shape and k.dim() == 3 and kv_cache.dim() == 5 and kv_cache.is_contiguous()
                and k.shape[1:] == kv_cache.shape[3:] and k.stride(2) == v.stride(2) == 1
                and k.stride(1) == v.stride(1) == k.shape[2] and slot_mapping.dtype == torch.int64
                and slot_mapping.is_contiguous() and slot_mapping.shape == (k.shape[0],)):
            return False
        size = k.element_size()
        if self._write_kv(k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, kv_cache.data_ptr(),
                          kv_cache.shape[0], kv_cache.shape[2], k.shape[1] * k.shape[2] * size,
                          slot_mapping.data_ptr(), k.shape[0]):
            raise IndexError(f"a KV slot is outside the cache's {kv_cache.shape[0] * kv_cache.shape[2]} slots")
        return True

    @staticmethod
    def supports_dtype(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    @staticmethod
    def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return (q.device.type == "cpu" and kv_cache.device.type == "cpu" and q.dtype == kv_cache.dtype
                and q.dtype in _DTYPES and kv_cache.is_contiguous())

    def __call__(
        self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
        scale: float, start: int = 0, with_lse: bool = False, sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of q [G, H, D] (sequence g's one query token; H a multiple of the
        cache's Hkv, query head h using kv head h // (H / Hkv)) to sequence g's cached
        positions [start, seq_lens[g]), with kv_cache [num_blocks, 2, block_size, Hkv, D]
        (contiguous, q's dtype, which `supports` checks) and block_tables [G, >=
        cdiv(seq_lens[g], block_size)] int64 (entries past a sequence's length are
        never read). Every seq_lens[g] must exceed `start`, a multiple of the block
        size: a length not above it, a table too narrow for a length or a block id
        outside the cache is a ValueError, raised before anything is read. Returns out [G, H, D] in q's dtype and, with `with_lse`, each row's
        log-sum-exp of its scaled scores [G, H] float32 (else None). Runs on torch's
        intra-op thread count; the GIL is released during the call. Besides the
        outputs, each thread holds a scratch of about (query rows of a task) x (longest
        context - start) floats during the call. Raises MemoryError if that fails.

        `sliding_window` w: sequence g's query (at position seq_lens[g] - 1) sees only
        positions >= max(start, seq_lens[g] - w). `soft_cap` c: scores s become
        c * tanh(s / c) before the softmax (and the log-sum-exp is of those)."""
        num_seqs, num_heads, head_size = q.shape
        num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
        if q.stride(2) != 1 or q.stride(1) != head_size:
            q = q.contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
            raise ValueError(f"block_tables {tuple(tables.shape)} and seq_lens {tuple(lens.shape)} must have "
                             f"one row per query ({num_seqs})")
        out = torch.empty(num_seqs, num_heads, head_size, dtype=q.dtype)
        lse = torch.empty(num_seqs, num_heads, dtype=torch.float32) if with_lse else None
        status = self._fns[q.dtype](
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), kv_cache.shape[0], tables.data_ptr(), tables.stride(0),
            tables.shape[1], lens.data_ptr(), start, out.data_ptr(), lse.data_ptr() if lse is not None else None,
            num_seqs, num_kv_heads, num_heads // num_kv_heads, head_size, block_size, scale,
            sliding_window or 0, soft_cap or 0.0, torch.get_num_threads(),
        )
        if status == 1:
            raise MemoryError("paged decode attention could not allocate its scratch buffers")
        if status:
            raise ValueError(_INPUT_ERRORS[status].format(start=start, blocks=kv_cache.shape[0],
                                                          width=tables.shape[1], block_size=block_size))
        return out, lse


def build_or_load() -> PagedDecodeKernel | None:
    """The kernel, built if this machine has none cached; None where it cannot be (the
    reason is logged) or `TP_CPU_PAGED_DECODE=0`. Reads the environment on each call."""
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBS, PagedDecodeKernel,
                       "CPU paged decode kernel unavailable (%s); decode attention uses torch's SDPA",
                       switch="TP_CPU_PAGED_DECODE")


# Once per process: every layer and every engine of a process shares the loaded library.
load = functools.cache(build_or_load)
