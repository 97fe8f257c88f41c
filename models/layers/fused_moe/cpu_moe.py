"""A decode step's experts in one C call on the CPU (`cpu_moe.c`), for bfloat16 and float16.

`grouped_moe.grouped_fused_experts` groups a batch's (token, expert) pairs in torch and
loops over the active experts in Python, reading the per-expert counts on the host: a
step holding it cannot be recorded as a CPU graph (worker/cpu_graph.py refuses the host
read), so a MoE model's decode steps ran eagerly, Python and all. `cpu_moe.c` does the
same grouping and products inside one C call that reads the routing from tensors, so
the whole step records and replays. Its products read the experts' weights as loaded:
bfloat16 experts in our bf16 register tile on CPUs with AVX-512 BF16 (an expert's one
token: one row after another, `bf16_row_dot.h`, as the dense one-token GEMV); the
others (float16 experts, a GGUF F16 file's default dtype; bfloat16 ones on CPUs without
AVX-512 BF16) widened to float32 as they are read: on AVX-512 in the 16-lane tiles of
`half_tile.h` (as the dense float16 product there), else in the AVX2 dot products of
`half_dot.h`, a lone token one weight row at a time; up to
`MAX_TOKENS` tokens (a decode step's batch), where these are the faster product; a
prefill's larger batches keep the grouped GEMMs. Float16 experts went through the
grouped path before, eagerly: a Qwen3-MoE F16 GGUF decode step 15.8 ms at batch 1 and
89 ms at 16 sequences, 10.9-12.7 and 55-61 ms now, against 11.2 and 36 ms for the same
file as bfloat16 (2026-12-07, the Zen 4 VM).

Built on first use like the other CPU kernels (distributed/native_build.py), on CPUs
with AVX2, FMA and F16C (AVX-512 adds the 16-lane tiles, AVX-512 BF16 the bf16 tile);
`TP_CPU_MOE_KERNEL=0` turns it off. Called by `FusedMoE.forward` on every rank with this rank's experts and the routing
every rank computed alike. Memory: for the call, the pairs' gathered rows and
activations (H + I values a pair: bf16 for the tile, float32 for the dot products),
their gate/up products and outputs (16-bit, 2I + H a pair) and the sorting's indices;
nothing is kept.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from distributed.native_build import BF16_CONVERT_H, FP16_CONVERT_H, load_kernel
from distributed.native_calls import NativeLibrary
from models.layers.cpu_sgemm import cpu_has_avx2

SOURCES = (Path(__file__).with_name("cpu_moe.c"), Path(__file__).parent.parent / "bf16_tile.h",
           Path(__file__).parent.parent / "bf16_row_dot.h",
           Path(__file__).parent.parent / "tile_sum.h", Path(__file__).parent.parent / "half_dot.h",
           Path(__file__).parent.parent / "half_tile.h", BF16_CONVERT_H, FP16_CONVERT_H)
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
LINK_LIBS = ("-lm",)
#: Up to this many tokens (a decode step's batch) the C call computes the experts.
MAX_TOKENS = 64


class CpuMoeKernel:
    """The loaded library's `cpu_moe_experts`; `products` says which products the build
    computes bfloat16 experts of two or more tokens with: "bf16_tile" (AVX-512 BF16),
    "half_tile" (the 16-lane widened tiles, AVX-512 without BF16) or "avx2" (float16
    experts take "half_tile" on every AVX-512 build, "avx2" elsewhere)."""

    def __init__(self, lib: NativeLibrary, path: Path) -> None:
        self.path = path
        lib.cpu_moe_products.restype = ctypes.c_int
        self.products = {1: "bf16_tile", 2: "avx2", 3: "half_tile"}[lib.cpu_moe_products()]
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._moe = lib.cpu_moe_experts
        self._moe.restype = ctypes.c_int
        self._moe.argtypes = [p, i64, i64, i64, p, p, i64, i64, p, p, i64, p, i64, p, i32, i32]

    def experts(self, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int) -> torch.Tensor:
        """`grouped_fused_experts`' result ([T, H] in the experts' dtype, a new tensor) for
        `hidden_states` [T, H] (unit stride along H) and contiguous `w13` [E_local, 2I, H],
        `w2` [E_local, H, I], all bfloat16 or all float16; float32 `topk_weights` and int64
        `topk_ids` [T, k], contiguous; `expert_map` [num_experts] int64 or None. Raises
        ValueError for an expert id outside the model's (or experts too large for the
        kernel's 32-bit count of row blocks), MemoryError without scratch."""
        tokens, hidden = hidden_states.shape
        out = torch.empty(tokens, hidden, dtype=hidden_states.dtype)
        status = self._moe(hidden_states.data_ptr(), hidden_states.stride(0), tokens, hidden, w13.data_ptr(),
                           w2.data_ptr(), w13.shape[0], w2.shape[2], topk_weights.data_ptr(), topk_ids.data_ptr(),
                           topk_ids.shape[1], None if expert_map is None else expert_map.data_ptr(), num_experts,
                           out.data_ptr(), int(hidden_states.dtype == torch.bfloat16), torch.get_num_threads())
        if status == -3:
            raise MemoryError("cpu_moe_experts: no memory for the pairs' scratch")
        if status == -4:
            raise ValueError(f"cpu_moe_experts: {w13.shape[0]} experts of {w2.shape[2]} x {hidden} make more than "
                             "2^31 blocks of rows in one product")
        if status:
            raise ValueError(f"cpu_moe_experts: an expert id outside the model's {num_experts} experts, or one the "
                             f"expert map sends past this rank's {w13.shape[0]}")
        return out


@functools.cache
def load() -> CpuMoeKernel | None:
    """The kernel, built if this machine has none cached; None on a CPU without AVX2 and
    FMA, where it cannot be built (logged once) or with `TP_CPU_MOE_KERNEL=0`."""
    if not cpu_has_avx2():
        return None
    return load_kernel(SOURCES, COMPILE_FLAGS, LINK_FLAGS, LINK_LIBS, CpuMoeKernel,
                       "CPU MoE kernel unavailable (%s); experts are grouped in torch", switch="TP_CPU_MOE_KERNEL")


def serves(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> CpuMoeKernel | None:
    """The kernel where it computes this call (bfloat16 or float16 CPU tensors, contiguous
    weights, at most MAX_TOKENS tokens), else None."""
    if not (hidden_states.device.type == "cpu" and hidden_states.dtype == w13.dtype == w2.dtype
            and hidden_states.dtype in (torch.bfloat16, torch.float16)
            and 0 < hidden_states.shape[0] <= MAX_TOKENS and hidden_states.stride(1) == 1
            and w13.is_contiguous() and w2.is_contiguous()):
        return None
    return load()
