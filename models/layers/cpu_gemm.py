"""Pre-packed GEMM on the CPU, for decode-sized batches above all.

For a decode step a linear layer multiplies a few rows (one per running sequence) by
its whole weight. An ordinary GEMM re-packs the weight into its kernel layout on every
call, and for a handful of rows that packing costs as much as the product; a weight
packed once, after loading, removes it (1.4-2x faster per layer at 8-64 rows on the
2-core development VMs). Three kernels can pack float32: MKL, oneDNN and our AVX2 kernel
(`cpu_sgemm.py`); which is fastest depends on the CPU (`default_packed_gemm`). MKL's
packed product only pays for few rows, so `PackedWeight.linear` sends MKL's larger
batches (prefill) to the plain sgemm; oneDNN's and ours are also the faster ones for
prefill batches, so they serve every row count. bfloat16/float16 weights are packed by
oneDNN in their own dtype where the CPU has a GEMM for it (AVX-512 BF16/FP16, AMX:
`native_half_gemm`): 1.4x F.linear's bf16 product at 32 rows on the AVX-512 BF16 dev
VM, 1.07x at 2048. This is the CPU counterpart of what vLLM's CPU backend does with
oneDNN in `process_weights_after_loading`.

The kernel only: `CPUUnquantizedLinearMethod` (models/layers/unquantized.py) decides
which weights get a packed copy and when.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator

import torch
import torch.nn.functional as F

from models.layers import cpu_sgemm

# ideep (torch's oneDNN glue) and oneDNN keep one primitive per (weight, row count) they
# have seen, up to 1024 each at about 0.5 MiB. A server sees every batch size from 1 to
# max_num_seqs, so that grew each rank by ~66 MiB per 100 requests until ~1 GB, which
# looks like a leak (tests/reliability/test_soak.py). A step needs one per packed weight
# shape (four or five) and batch sizes drift slowly, so 64 keeps the last dozen sizes
# cached (a miss rebuilds one in ~3 ms) in at most ~64 MiB. Read at first use, so setting
# them here, before any weight is packed, is early enough; a value the user set wins.
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

# Up to this many rows MKL's packed product wins: a 12-layer decode step's linears on the
# 2-core VM take 63 ms packed vs 94 ms plain at 64 rows, 72 vs 72 at 96, and above that
# the plain sgemm is as fast or faster. oneDNN's packed product has no such limit: on the
# AMD dev VM the four linears of a 100M llama layer take 11.8 ms against F.linear's 19.1
# at 100 rows, 24.8 vs 30.7 at 256 and 136 vs 161 at 1536 (the mixed decode+prefill
# steps of a server, and prefill chunks), so it serves every row count.
PACKED_MAX_ROWS = 96
# The row count the library is told when packing. The packed layout of the weight does not
# depend on it (checked at pack time, see PackedWeight.verify), only the op's
# bookkeeping does, so every call passes its own row count.
_PACK_HINT_ROWS = 32


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN packed product runs with: exact for decode batches (up to
    PACKED_MAX_ROWS: padding 13 rows to 16 costs 11% here, 57 to 64 13%), the next
    multiple of 64 above (prefill chunks, where the padding is a few per cent), so
    that prefill adds at most max_num_batched_tokens / 64 primitives per weight shape."""
    if rows <= PACKED_MAX_ROWS:
        return rows
    return -(-rows // 64) * 64


PACKED_GEMMS = ("mkl", "onednn", "avx2")


def packing_available(kernel: str) -> bool:
    if kernel == "avx2":
        return cpu_sgemm.load() is not None
    return onednn_packing_available() if kernel == "onednn" else mkl_packing_available()


def mkl_packing_available() -> bool:
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def native_half_gemm(weight: torch.Tensor) -> bool:
    """A bfloat16/float16 CPU weight on a CPU whose oneDNN has a GEMM for that dtype (AVX-512
    BF16/FP16, AMX): oneDNN packs it in its own dtype (`PackedWeight(weight, "onednn")`)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not onednn_packing_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if weight.dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def lacks_native_gemm(weight: torch.Tensor) -> bool:
    """A bfloat16/float16 CPU weight on a CPU with no GEMM for that dtype (no AVX-512
    BF16/FP16, AMX or AVX-NE-CONVERT): oneDNN then converts the weight on every call, about
    4x slower than float32 at decode sizes and 8x at prefill sizes on the AVX2 dev VM."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not onednn_packing_available():
        return False
    if weight.dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if weight.dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def onednn_packing_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def default_packed_gemm() -> str:
    """Which kernel packs, by CPU: MKL on Intel (the fastest at decode sizes there); our
    AVX2 kernel on other CPUs without AVX-512 (1.2-1.5x oneDNN at 1-48 rows on the AMD
    dev VM, on par above), where it builds; oneDNN elsewhere (MKL takes slow generic
    paths on AMD: 1.3-1.6x slower whole decode runs here). `TP_CPU_PACKED_GEMM=mkl|
    onednn|avx2` overrides (an avx2 kernel that cannot be built falls back to oneDNN)."""
    choice = os.environ.get("TP_CPU_PACKED_GEMM")
    if choice == "avx2" and not packing_available("avx2"):
        choice = None
    if choice in PACKED_GEMMS:
        return choice
    if _cpu_vendor() == "GenuineIntel" and mkl_packing_available():
        return "mkl"
    if cpu_sgemm.cpu_has_avx2() and not cpu_sgemm.cpu_has_avx512() and packing_available("avx2"):
        return "avx2"
    return "onednn" if onednn_packing_available() else "mkl"


def upcast_gemm(kernel: str) -> str:
    """The kernel for the float32 copy of a bf16/fp16 weight (`lacks_native_gemm`): one
    that serves every row count, since that copy is the only one used."""
    return "avx2" if kernel == "avx2" else "onednn"


# The float32 buffer that `upcast_float32` reuses inside `reusing_upcast_buffer()`: a list
# holding at most one tensor, grown to the largest weight seen. None outside the context.
_UPCAST_BUFFER: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "upcast_buffer", default=None)


@contextlib.contextmanager
def reusing_upcast_buffer() -> Iterator[None]:
    """While packing a whole model, let `upcast_float32` convert every weight into one
    buffer instead of a fresh tensor each. A fresh float32 copy is memory the kernel
    has to fault in page by page, only for the copy to be packed and dropped: for the
    1.34 GB bfloat16 llama that was 1.0 of a 3.7 s wake-up (2.7 GB faulted), and reusing
    one buffer saves about a third of the packing time here. The buffer (the largest
    weight's size in float32) is freed when the block ends. Called by whoever packs
    every layer in one pass (model_loader.utils.process_weights_after_loading,
    prepack_cpu_weights); on every rank, on the thread that packs."""
    token = _UPCAST_BUFFER.set([])
    try:
        yield
    finally:
        _UPCAST_BUFFER.reset(token)


def upcast_float32(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in float32: a view of the shared buffer inside `reusing_upcast_buffer()`
    (valid until the next call: pack it before converting another), else a new tensor."""
    held = _UPCAST_BUFFER.get()
    if held is None:
        return weight.float()
    if not held or held[0].numel() < weight.numel():
        held[:] = [torch.empty(weight.numel(), dtype=torch.float32, device=weight.device)]
    return held[0][: weight.numel()].view(weight.shape).copy_(weight)


# A memo of PackedWeight.verify's answer per (kernel, shape, dtype): a property of the
# packing library on this CPU, so it stays valid for the process's lifetime.
_VERIFIED: dict[tuple[str, tuple[int, ...], torch.dtype], bool] = {}


class PackedWeight:
    """A packed copy of one [out, in] weight; `linear` computes x W^T (+ b) for x of the
    weight's dtype (float32; bfloat16/float16 with oneDNN only, `native_half_gemm`)."""

    def __init__(self, weight: torch.Tensor, kernel: str) -> None:
        """`kernel`: one of PACKED_GEMMS (`default_packed_gemm()`), available here."""
        assert weight.dtype == torch.float32 or kernel == "onednn", "only oneDNN packs bf16/fp16 weights"
        self.kernel = kernel
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        if kernel == "avx2":
            self.sgemm = cpu_sgemm.load()
            assert self.sgemm is not None, "the avx2 kernel is not available (packing_available)"
            self.packed = self.sgemm.pack(weight)
        elif kernel == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
        else:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)

    def _onednn_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """oneDNN's packed product, prefill rows padded to a bucket (`onednn_rows`):
        oneDNN builds (about 3 ms each here) and caches one primitive per row count."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        rows = x.shape[0]
        padded = onednn_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return out[:rows].reshape(*shape[:-1], self.out_features)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`weight` must be the tensor this was packed from (MKL's bookkeeping and its
        large-batch path use it). oneDNN's and the avx2 packed products serve every row
        count, MKL's up to PACKED_MAX_ROWS (above, F.linear)."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or x.dtype != self.dtype:
            return F.linear(x, weight, bias)
        if self.kernel == "avx2":
            return self.sgemm.linear(x, self.packed, self.out_features, bias)
        if self.kernel == "onednn":
            return self._onednn_linear(x, bias)
        if rows > PACKED_MAX_ROWS:
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, weight, bias, rows)

    def linear_any_rows(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The packed product for every row count, with no unpacked weight needed (oneDNN
        and avx2 only, `upcast_gemm`; for the float32 copies of bf16/fp16 weights)."""
        assert self.kernel in ("onednn", "avx2")
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.kernel == "avx2":
            return self.sgemm.linear(x, self.packed, self.out_features, bias)
        return self._onednn_linear(x, bias)

    def verify(self, weight: torch.Tensor) -> bool:
        """Whether the packed product matches F.linear for a few row counts: the
        packed layout being independent of the row count is library behaviour, not an
        API promise, so it is checked rather than assumed, once per kernel, weight
        shape and dtype in a process (it depends on nothing else, and checking every
        layer of a large model reads its weights six more times: 9 s of a 16 s load
        of a 1.3 GB bfloat16 llama here)."""
        key = (self.kernel, tuple(weight.shape), weight.dtype)
        if key not in _VERIFIED:
            _VERIFIED[key] = self._verify(weight)
        return _VERIFIED[key]

    def _verify(self, weight: torch.Tensor) -> bool:
        generator = torch.Generator().manual_seed(0)
        # float32 kernels differ from F.linear only by reassociation; a half-precision one
        # also rounds its output, so it may be a unit in the last place off.
        rel = 1e-4 if weight.dtype == torch.float32 else 2 * torch.finfo(weight.dtype).eps
        for rows in (1, 7, _PACK_HINT_ROWS + 1):
            x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
            expected = F.linear(x.float(), weight.float())
            got = self.linear(x, weight)  # at most PACKED_MAX_ROWS rows: packed, for either kernel
            tolerance = rel * (1.0 + expected.abs().max().item())
            if got.shape != expected.shape or not torch.allclose(got.float(), expected, rtol=rel, atol=tolerance):
                return False
        return True
