"""int8 activations x int8 weights for W8A8 layers: per-token quantisation and the GEMM.

`quantize_per_token(x)` gives each row of x its own symmetric scale (dynamic: computed
per call, nothing stored). `int8_linear(xq, x_scale, weight, weight_scale, bias,
out_dtype)` computes `(xq @ weight.T) * x_scale * weight_scale (+ bias)` with exact
int32 sums through `torch._int_mm`, which on x86 CPUs with VNNI or AMX is oneDNN's int8
GEMM and on CUDA cuBLASLt's, or through int8_cpu.c's own GEMM (the same exact sums):
- on AVX-512 VNNI CPUs for 1-40 tokens (`VNNI_GEMM_TOKENS`), where oneDNN's, reading the
  checkpoint's [N, K] weight as the transposed operand, slows down: a 8192x1024 weight
  (in cache, 2 threads, 2026-12-06, the Zen 4 VM) took 67 us at 1 token and 367 at 2,
  and a 1024x4096 one 42 and 729 us; int8_cpu.c's (vpdpbusd on 4x4 register tiles)
  takes 84 and 50 us at 2 tokens, 2-15x less up to 24 tokens, and ties at 32 except
  where K is large (0.43x the time at K = 4096). Since its tiles ask for the rows 64 KiB
  ahead, ours streams a weight from memory faster (2026-12-07, same VM, 2 threads): at 1
  token 0.78-0.96x oneDNN's time, at 32-40 tokens 0.48-0.86x on 4096- and 11008-wide
  weights (1536x1024: 0.99-1.04x); from 48 tokens oneDNN's blocked GEMM gains. Where
  oneDNN's runs on AMX tiles (`amx_int8`), only up to `AMX_VNNI_GEMM_TOKENS` tokens
  (`vnni_gemm_tokens`);
- without VNNI or AMX, where torch._int_mm is a reference loop (0.6 GOP/s): int8_cpu.c's
  AVX2 GEMM (16-bit products in vpmaddwd).

The steps around it are one C pass each on the CPU (`kernels/int8_cpu.c`), for float32
and bfloat16 activations: the torch expressions took six and four passes, and their
per-call overhead cost a 0.31B-parameter model's W8A8 decode more time than the
GEMMs' difference to bf16 (2026-12-05: 1.4 s of quantisation in a 8.3 s run). The C
passes compute the same bits as the torch expressions, which stay the path elsewhere
(CUDA, float16, no compiler, `TP_CPU_INT8_KERNELS=0`).

Called from the W8A8 int8 scheme's `apply_weights`, on every rank, with this rank's
shard, and from the W8A8 experts (int8_moe.py), whose decode steps run in one call of the
same library (`kernels/int8_moe.c`, on int8_cpu.c's passes and GEMM tiles). Memory: the
int8 activations and an int32 [M, N] product besides the output.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from distributed.native_build import BF16_CONVERT_H, cpu_flags, load_kernel
from distributed.native_calls import NativeLibrary
from models.layers.cpu_bf16_gemm import onednn_runs_amx

INT8_MAX = 127.0
_MIN_SCALE = 1e-12  # an all-zero row gets this scale: its values stay exactly 0
_CUDA_INT_MM_MIN_ROWS = 16  # cuBLASLt's int8 GEMM wants more rows than this
#: Token counts whose products take int8_cpu.c's VNNI GEMM over oneDNN's (module docstring).
VNNI_GEMM_TOKENS = range(1, 41)
#: ... where oneDNN's int8 GEMM runs on AMX. Ours / torch._int_mm, us, 2 threads, weights cycled
#: (2026-12-07, an Intel Xeon VM with AMX), 4096x1024, 1024x4096, 4096x4096: 1 token 104 / 243, 130 / 214,
#: 623 / 1374; 8 tokens 191 / 244, 218 / 238, 770 / 1280; 16 tokens 330 / 248, 336 / 246, 1303 / 1395; 24
#: tokens 443 / 289, 479 / 269, 1823 / 1450; 40 tokens 708 / 351, 757 / 340, 2876 / 1624.
AMX_VNNI_GEMM_TOKENS = range(1, 13)

SOURCE = Path(__file__).with_name("kernels") / "int8_cpu.c"
# int8_moe.c (a decode step's W8A8 experts, quantization/int8_moe.py) builds into the same
# library; a change to a header rebuilds it
SOURCES = (SOURCE, SOURCE.with_name("int8_moe.c"), SOURCE.parent.parent.parent / "tile_sum.h",
           SOURCE.parents[2] / "fused_moe" / "expert_pairs.h", BF16_CONVERT_H)
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
_C_DTYPES = (torch.float32, torch.bfloat16)  # what the C passes read and write


class Int8Kernel:
    """The loaded library: its two passes and its GEMM (and `lib`, where int8_moe.py binds
    the experts' one-call entry)."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.lib, self.path = lib, path  # lib: also int8_moe.c's entry (quantization/int8_moe.py binds it)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._quantize, self._scale = lib.int8_quantize_per_token, lib.int8_scale_output
        self._quantize.restype = self._scale.restype = None
        self._quantize.argtypes = [p, i32, i64, i64, i64, p, p, i32]
        self._scale.argtypes = [p, i64, i64, i64, p, p, p, p, i32, i64, i32]
        self._gemm = lib.int8_gemm_s32
        self._gemm.restype = i32
        self._gemm.argtypes = [p, i64, i64, p, i64, i64, i64, p, i64, i32]
        # Whether the build has the int8 GEMM (`gemm`), and whether it is the AVX-512 VNNI one
        isa = lib.int8_has_gemm()
        self.has_gemm = isa > 0
        self.gemm_vnni = isa == 2

    def gemm(self, xq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """xq [M, K] @ weight [N, K]^T as int32 [M, N], exact; both int8 with unit stride
        along K (rows at any stride: a shard's view). MemoryError if its scratch (AVX2: a
        chunk of xq widened to 16 bits; VNNI: xq's row sums) cannot be allocated."""
        m, k = xq.shape
        acc = torch.empty(m, weight.shape[0], dtype=torch.int32)
        if self._gemm(xq.data_ptr(), xq.stride(0), m, weight.data_ptr(), weight.stride(0), weight.shape[0], k,
                      acc.data_ptr(), acc.stride(0), torch.get_num_threads()):
            raise MemoryError("the int8 GEMM could not allocate its scratch")
        return acc

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        xq, scale = torch.empty(m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32)
        self._quantize(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), m, k, xq.data_ptr(), scale.data_ptr(),
                       torch.get_num_threads())
        return xq, scale

    def scale_output(self, acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        m, n = acc.shape
        out = torch.empty(m, n, dtype=out_dtype)
        self._scale(acc.data_ptr(), acc.stride(0), m, n, x_scale.data_ptr(), weight_scale.data_ptr(),
                    None if bias is None else bias.data_ptr(), out.data_ptr(), out_dtype == torch.bfloat16, n,
                    torch.get_num_threads())
        return out


@functools.cache
def load() -> Int8Kernel | None:
    """The passes, built if this machine has none cached; None where they cannot be (the
    reason is logged once) or `TP_CPU_INT8_KERNELS=0`."""
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, ("-lm",), Int8Kernel,
                       "CPU int8 activation kernels unavailable (%s); W8A8 layers quantise in torch",
                       switch="TP_CPU_INT8_KERNELS")


def _c_kernel(*tensors: torch.Tensor) -> Int8Kernel | None:
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return load()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] int8, scale [M] float32) with x ≈ xq * scale[:, None], each row scaled
    so its largest magnitude maps to 127 (round half to even, as torch rounds)."""
    kernel = _c_kernel(x)
    if kernel is not None and x.dtype in _C_DTYPES and x.dim() == 2 and x.stride(1) == 1:
        return kernel.quantize(x)
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp(min=_MIN_SCALE)
    xq = torch.round(xf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return xq, scale


@functools.cache
def torch_int_mm_has_int8_kernel() -> bool:
    """Whether torch._int_mm has an int8 kernel on this CPU: oneDNN's, where the CPU has
    VNNI (AVX-512 or AVX) or AMX. Without them it runs a reference loop (0.6 GOP/s at 32-128
    tokens of a 4096x1024 weight, 2026-12-06, the Zen 3 VM), and `int8_linear` takes
    int8_cpu.c's AVX2 GEMM instead. Asked on every W8A8 GEMM: answered once."""
    flags = cpu_flags().split()
    return any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


@functools.cache
def vnni_gemm_tokens() -> range:
    """The token counts our VNNI GEMM takes over torch._int_mm: AMX_VNNI_GEMM_TOKENS where
    oneDNN's int8 GEMM runs on AMX (`cpu_bf16_gemm.onednn_runs_amx`), else VNNI_GEMM_TOKENS."""
    return AMX_VNNI_GEMM_TOKENS if onednn_runs_amx(cpu_flags(), "amx_int8") else VNNI_GEMM_TOKENS


def int8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq [M, K] @ weight [N, K]^T) * x_scale [M] * weight_scale [N] (+ bias) in
    `out_dtype`, the integer sums exact and the scaling in float32."""
    m = xq.shape[0]
    kernel = _c_kernel(xq, weight)
    if (kernel is not None and kernel.has_gemm and xq.stride(-1) == 1 and weight.stride(-1) == 1
            and ((kernel.gemm_vnni and m in vnni_gemm_tokens()) or not torch_int_mm_has_int8_kernel())):
        acc = kernel.gemm(xq, weight)
    else:
        if xq.is_cuda and m <= _CUDA_INT_MM_MIN_ROWS:  # decode batches: pad with zero rows
            xq = torch.cat([xq, xq.new_zeros(_CUDA_INT_MM_MIN_ROWS + 1 - m, xq.shape[1])])
        acc = torch._int_mm(xq, weight.t())[:m]
    if kernel is not None and out_dtype in _C_DTYPES and acc.stride(1) == 1:
        scales = [s.to(torch.float32).reshape(-1).contiguous() for s in (x_scale, weight_scale)]
        return kernel.scale_output(acc, *scales, None if bias is None else bias.to(torch.float32).contiguous(),
                                   out_dtype)
    y = acc.to(torch.float32).mul_(x_scale.reshape(-1, 1)).mul_(weight_scale.reshape(1, -1))
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(out_dtype)
