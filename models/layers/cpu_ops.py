"""Fused CPU kernels for the small layers (`cpu_ops.c`): residual add + RMSNorm, the neox
rotary embedding of q and k (alone, or after Qwen3's per-head q/k norm), and the row-wise
argmax of greedy sampling.

torch runs a bfloat16 RMSNorm with a residual as five ops (add, upcast, norm, downcast,
scale) and the rotary as seven per tensor, each a dispatch and a pass over memory; at
decode sizes the dispatches dominate (about 40 and 60 µs a layer on the dev VM), at
prefill sizes the passes (the norm's upcast alone writes twice the activations). One C
call does each in one pass, rounding where torch's chain rounds. This is what vLLM's
RMSNorm and RotaryEmbedding custom ops do with their CPU kernels. torch's `max(dim=-1)`
finds a row's maximum and its index one element at a time (about 1 ns an element here:
0.5-1 ms for 32 rows of a 32k vocabulary, per step); the argmax kernel takes the
maximum 16 lanes at a time, then searches for its first occurrence.

Built on first use like the other CPU kernels (distributed/native_build.py). Where it
cannot be built, with `TP_CPU_FUSED_OPS=0`, or for tensors it does not take (not on the
CPU, not float32/bfloat16/float16, a last dimension that is not contiguous), the layers keep
their torch ops: the kernels are a speed-up, never a requirement. Called by the layers
on every rank; the GIL is released during each call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from distributed.native_build import BF16_CONVERT_H, FP16_CONVERT_H, load_kernel
from distributed.native_calls import NativeLibrary

SOURCE = Path(__file__).with_name("cpu_ops.c")
SOURCES = (SOURCE, BF16_CONVERT_H, FP16_CONVERT_H)  # a change to a header rebuilds
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBS = ("-lm",)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rows(t: torch.Tensor) -> bool:
    """A 2-D CPU tensor of a kernel dtype whose rows are contiguous."""
    return t.device.type == "cpu" and t.dim() == 2 and t.dtype in _DTYPES and t.stride(1) == 1


class CpuOpsKernel:
    """The loaded library; each method checks what it is given and says whether it ran."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path = path
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._norm, self._rotary, self._argmax = lib.cpu_rms_norm, lib.cpu_rotary_neox, lib.cpu_argmax_rows
        self._qk_norm_rope = lib.cpu_qk_norm_rope
        self._norm.restype = self._rotary.restype = self._argmax.restype = self._qk_norm_rope.restype = ctypes.c_int
        self._argmax.argtypes = [i32, p, i64, i64, i64, p, p, i32]
        self._norm.argtypes = [i32, p, i64, p, i64, p, p, i64, i64, i64, f32, i32]
        self._rotary.argtypes = [i32, p, i64, i64, p, i64, i64, i64, p, p, p, i64, i64, i64, i32]
        self._qk_norm_rope.argtypes = [i32, p, i64, i64, p, i64, i64, i64, p, p, f32, p, p, p, i64, i64, i64, i32]
        # For the communicator's fused all-reduce + norm, which calls it from its own kernel.
        self.norm_address: int = ctypes.cast(lib.cpu_rms_norm.fn, ctypes.c_void_p).value

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | None:
        """`weight * rms_norm(x + residual)` for x [T, n], after `x += residual` in place
        (rounded to x's dtype) when a residual is given; weight [n] of x's dtype. None,
        with nothing touched, for tensors the kernel does not take. Each thread holds one
        float32 row of scratch (16-bit dtypes); MemoryError if that fails."""
        if not (_rows(x) and weight.dtype == x.dtype and weight.is_contiguous() and weight.numel() == x.shape[1]
                and (residual is None or (_rows(residual) and residual.dtype == x.dtype
                                          and residual.shape == x.shape))):
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        status = self._norm(_DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                            None if residual is None else residual.data_ptr(),
                            0 if residual is None else residual.stride(0), weight.data_ptr(), out.data_ptr(),
                            out.stride(0), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        if status:
            raise MemoryError("RMSNorm kernel could not allocate its scratch row")
        return out

    @staticmethod
    def _rotary_takes(q: torch.Tensor, k: torch.Tensor, head_size: int, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> bool:
        """Whether the rotary kernels take these tensors (`rotary_neox`'s contract)."""
        return (_rows(q) and _rows(k) and q.dtype == k.dtype and q.shape[0] == k.shape[0] and head_size % 2 == 0
                and q.shape[1] % head_size == 0 and k.shape[1] % head_size == 0
                and positions.dtype == torch.int64 and positions.is_contiguous() and positions.numel() == q.shape[0]
                and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape
                and cos.stride(1) == sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
                and cos.shape[1] >= head_size // 2)

    def rotary_neox(self, q: torch.Tensor, k: torch.Tensor, head_size: int, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate q [T, Hq * head_size] and k [T, Hk * head_size] in place at positions [T]
        (int64) with the float32 tables cos, sin [P, >= head_size / 2] (row-contiguous).
        False, with nothing touched, for tensors the kernel does not take. Raises
        IndexError for a position outside the tables, before anything is written."""
        if not self._rotary_takes(q, k, head_size, positions, cos, sin):
            return False
        status = self._rotary(_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.shape[1] // head_size, k.data_ptr(),
                              k.stride(0), k.shape[1] // head_size, head_size, positions.data_ptr(), cos.data_ptr(),
                              sin.data_ptr(), cos.stride(0), cos.shape[0], q.shape[0], torch.get_num_threads())
        if status:
            raise IndexError(f"rotary embedding: a position is outside the table of {cos.shape[0]} positions "
                             "(max_model_len)")
        return True

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, head_size: int, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> bool:
        """Qwen3's per-head RMSNorm of q and k (weights [head_size] of their dtype) and then
        `rotary_neox`'s rotation, in place, each head exactly as the two calls compute it
        (vLLM's fused_qk_norm_rope). False, with nothing touched, for tensors the kernel
        does not take. IndexError for a position outside the tables, before anything is
        written; MemoryError (16-bit dtypes) if a thread's scratch row cannot be allocated."""
        if not (q.dtype == q_weight.dtype == k_weight.dtype and q_weight.is_contiguous() and k_weight.is_contiguous()
                and q_weight.numel() == k_weight.numel() == head_size and self._rotary_takes(q, k, head_size, positions,
                                                                                              cos, sin)):
            return False
        status = self._qk_norm_rope(_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.shape[1] // head_size,
                                    k.data_ptr(), k.stride(0), k.shape[1] // head_size, head_size,
                                    q_weight.data_ptr(), k_weight.data_ptr(), eps, positions.data_ptr(),
                                    cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[0], q.shape[0],
                                    torch.get_num_threads())
        if status == 2:
            raise IndexError(f"rotary embedding: a position is outside the table of {cos.shape[0]} positions "
                             "(max_model_len)")
        if status:
            raise MemoryError("q/k norm kernel could not allocate its scratch row")
        return True

    def argmax_rows(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first maximum of each row's first `n` elements of x [T, >= n]: its value
        (float32, [T]) and its index (int64, [T]), as `x[:, :n].float().max(-1)` gives
        them (a NaN is the maximum, the first one). None, with nothing made, for
        tensors the kernel does not take or n < 1."""
        if not (_rows(x) and 1 <= n <= x.shape[1]):
            return None
        rows = x.shape[0]
        values = torch.empty(rows, dtype=torch.float32)
        ids = torch.empty(rows, dtype=torch.int64)
        self._argmax(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), rows, n, values.data_ptr(), ids.data_ptr(),
                     torch.get_num_threads())
        return values, ids


def build_or_load() -> CpuOpsKernel | None:
    """The kernels, built if this machine has none cached; None where they cannot be (the
    reason is logged) or `TP_CPU_FUSED_OPS=0`. Reads the environment on each call."""
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBS, CpuOpsKernel,
                       "CPU fused-op kernels unavailable (%s); RMSNorm and rotary use torch ops",
                       switch="TP_CPU_FUSED_OPS")


# Once per process: every layer shares the loaded library.
load = functools.cache(build_or_load)
