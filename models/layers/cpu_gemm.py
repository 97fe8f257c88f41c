"""Pre-packed GEMM on the CPU, for decode-sized batches above all.

For a decode step a linear layer multiplies a few rows (one per running sequence) by
its whole weight. An ordinary GEMM re-packs the weight into its kernel layout on every
call, and for a handful of rows that packing costs as much as the product; a weight
packed once, after loading, removes it (1.4-2x faster per layer at 8-64 rows on the
2-core development VMs). Three kernels can pack float32: oneDNN, our AVX2 kernel
(`cpu_sgemm.py`) and MKL; `default_packed_gemm` picks by CPU. oneDNN's and ours serve
every row count and can give the plain weight back exactly (`PackedWeight.unpack`), so
their packed layout replaces the weight (`models/layers/packed_tensor.py`). MKL's packed
product only pays for few rows and needs the plain weight beside it (its large batches
run the plain sgemm), so it is never the default: `TP_CPU_PACKED_GEMM=mkl` chooses it,
at twice the linear weights' memory. bfloat16/float16 weights are packed by oneDNN in
their own dtype where the CPU has a GEMM for it (AVX-512 BF16/FP16, AMX:
`native_half_gemm`): 1.4x F.linear's bf16 product at 32 rows on the AVX-512 BF16 dev
VM, 1.07x at 2048. This is the CPU counterpart of what vLLM's CPU backend does with
oneDNN in `process_weights_after_loading`.

The kernel only: `CPUUnquantizedLinearMethod` (models/layers/unquantized.py) decides
which weights are packed and when.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import Iterator

import torch
import torch.nn.functional as F

from models.layers import cpu_bf16_gemm, cpu_sgemm

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
# A float16 weight read in place where oneDNN has an FP16 GEMM (AVX512-FP16 CPUs): our
# widening kernel up to this many rows, F.linear above. Ours / oneDNN's packed weight /
# F.linear, ms, 2 threads of an Intel Xeon VM with AMX and AVX512-FP16 (2026-12-07), 2048x2048
# and 5632x2048: 1 row 0.45 / 0.55 / 0.55, 0.86 / 1.17 / 1.23; 4 rows 0.26 / 0.54 / 0.60,
# 0.60 / 1.27 / 1.44; 16 rows 0.69 / 0.97 / 0.96, 1.78 / 2.05 / 2.24; 32 rows 1.28 / 1.31 /
# 1.34, 3.31 / 3.46 / 3.53; 64 rows 3.25 / 2.02 / 1.99, 8.47 / 5.47 / 5.36.
NATIVE_HALF_MAX_ROWS = 32
# The row count the library is told when packing. The packed layout of the weight does not
# depend on it (checked once per shape class, see PackedWeight.verify), only the op's
# bookkeeping does, so every call passes its own row count.
_PACK_HINT_ROWS = 32
# What a packed layout can depend on besides the library, the dtype and the CPU: each
# dimension below _SHAPE_CLASS_LIMIT, and above it its residue modulo the kernels' block
# sizes. Every block size the libraries use (oneDNN's 16/32/48/64-wide output and 2-4
# deep input blocks, AMX's 16x32 tiles, our 16-column panels) divides
# _SHAPE_CLASS_PERIOD. On the Zen 5 VM oneDNN's bf16 layout was AB16b64a2b and its
# float32 one AB16b64a for every shape from 2 to 32000 rows and columns (float32: plain
# for one output row), so this is conservative.
_SHAPE_CLASS_PERIOD = 384
_SHAPE_CLASS_LIMIT = 2 * _SHAPE_CLASS_PERIOD


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
    return weight.device.type == "cpu" and weight.dim() == 2 and _lacks_native_gemm(weight.dtype)


@functools.cache  # the CPU's and torch's: asked per call by the FP8, WNA16 and MoE tiles
def _lacks_native_gemm(dtype: torch.dtype) -> bool:
    if not onednn_packing_available():
        return False
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def widens_half_weights(weight: torch.Tensor) -> bool:
    """Whether a bfloat16/float16 CPU weight is multiplied where it was loaded by the AVX2
    kernel (`cpu_sgemm.linear_half`, widening it to float32) rather than packed: the CPU's
    oneDNN has no GEMM for its dtype (`lacks_native_gemm`: AVX2 CPUs, and AVX-512 ones
    without BF16/FP16), or the weight is float16 (where oneDNN has an FP16 GEMM, ours
    still leads up to `NATIVE_HALF_MAX_ROWS` rows and F.linear takes more: see there), the
    kernel builds here, and neither `TP_CPU_BF16_GEMM=0` nor `TP_CPU_PACKED_GEMM` asks for
    another kernel (which then packs a float32 copy). Asked once per weight, at load."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.stride(1) == 1
            and (widens_half_dtype(weight.dtype) or (weight.dtype == torch.float16 and _widening_allowed())))


def _widening_allowed() -> bool:
    """Neither switch asks for another kernel, and ours builds here."""
    return (os.environ.get(cpu_bf16_gemm.SWITCH, "1") != "0" and os.environ.get("TP_CPU_PACKED_GEMM", "avx2") == "avx2"
            and packing_available("avx2"))


def half_linear_rows(dtype: torch.dtype) -> int | None:
    """The most rows of input our widening kernel multiplies for a `dtype` weight it reads in
    place (`widens_half_weights`): all (None) where oneDNN has no GEMM for the dtype,
    NATIVE_HALF_MAX_ROWS where it has one (F.linear, its reorder a small part of the
    work, above)."""
    return None if _lacks_native_gemm(dtype) else NATIVE_HALF_MAX_ROWS


def widens_half_dtype(dtype: torch.dtype) -> bool:
    """Whether 16-bit tiles of `dtype` a kernel dequantises (fp8, MoE experts) go through our
    widening kernel: where oneDNN has no GEMM for the dtype (`lacks_native_gemm`), as for
    the dense weights. `TP_CPU_BF16_GEMM=0` answers False here as there (read on each call)."""
    return _lacks_native_gemm(dtype) and _widening_allowed()


def onednn_packing_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def default_packed_gemm() -> str:
    """Which kernel packs float32, by CPU: our AVX2 kernel on CPUs without AVX-512 (1.2-1.5x
    oneDNN at 1-48 rows on the AMD dev VM, on par above), where it builds; oneDNN
    elsewhere. MKL was the Intel default until packing came to replace the weight: its
    packed copy cannot serve large batches nor give the weight back, so it must sit
    beside the plain weight, and its decode-size edge over oneDNN on Intel was never
    worth holding the weights twice; it is now an explicit choice (on AMD it takes slow
    generic paths: 1.3-1.6x slower whole decode runs). `TP_CPU_PACKED_GEMM=mkl|onednn|
    avx2` overrides (an avx2 kernel that cannot be built falls back to oneDNN)."""
    choice = os.environ.get("TP_CPU_PACKED_GEMM")
    if choice == "avx2" and not packing_available("avx2"):
        choice = None
    if choice in PACKED_GEMMS:
        return choice
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


def shape_class(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The smallest shape whose packed layout is that of `shape` (see _SHAPE_CLASS_PERIOD):
    each dimension up to _SHAPE_CLASS_LIMIT + _SHAPE_CLASS_PERIOD as it is, a larger one
    replaced by the number in [_SHAPE_CLASS_LIMIT, +_SHAPE_CLASS_PERIOD) with its residue."""
    return tuple(d if d < _SHAPE_CLASS_LIMIT + _SHAPE_CLASS_PERIOD
                 else _SHAPE_CLASS_LIMIT + (d - _SHAPE_CLASS_LIMIT) % _SHAPE_CLASS_PERIOD for d in shape)


# A memo of PackedWeight.verify's answer per (kernel, dtype, shape class): a property of the
# packing library on this CPU, so it stays valid for the process's lifetime.
_VERIFIED: dict[tuple[str, torch.dtype, tuple[int, ...]], bool] = {}


class PackedWeight:
    """One [out, in] weight in a kernel's packed layout (`packed`); `linear` computes
    x W^T (+ b) for x of the weight's dtype (float32; bfloat16/float16 with oneDNN only,
    `native_half_gemm`). oneDNN's and the avx2 kernel's layouts give the weight back
    exactly (`unpack`), so they can stand in for it (`holds_whole_weight`); MKL's cannot.
    `repack` packs new values in the same layout, in place of the old ones.

    Memory: `packed` only: the weight's bytes, padded to the kernel's blocks (oneDNN pads
    out to 64 and in to 16-32 on AVX-512; the avx2 kernel out to 16)."""

    def __init__(self, weight: torch.Tensor, kernel: str) -> None:
        """`kernel`: one of PACKED_GEMMS (`default_packed_gemm()`), available here."""
        assert weight.dtype == torch.float32 or kernel == "onednn", "only oneDNN packs bf16/fp16 weights"
        self.kernel = kernel
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        if kernel == "avx2":
            self.sgemm = cpu_sgemm.load()
            assert self.sgemm is not None, "the avx2 kernel is not available (packing_available)"
        self.packed: torch.Tensor | None = self._pack(weight)
        # Where each row and column lies in `packed` (models/layers/packed_rows.py's cache).
        self.row_index: tuple[torch.Tensor, torch.Tensor] | None = None

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if self.kernel == "avx2":
            return self.sgemm.pack(weight)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)

    @property
    def holds_whole_weight(self) -> bool:
        """Whether `packed` serves every row count and gives the weight back (`unpack`):
        oneDNN's and the avx2 kernel's layouts, not MKL's."""
        return self.kernel != "mkl"

    @property
    def nbytes(self) -> int:
        """The bytes `packed` holds, padding included (0 once released)."""
        if self.packed is None:
            return 0
        if self.kernel == "onednn":
            return int(torch.ops.mkldnn._nbytes(self.packed))
        return self.packed.numel() * self.packed.element_size()

    def unpack(self) -> torch.Tensor:
        """The plain [out, in] weight, exactly the values packed, as a new tensor (the one
        extra weight a caller holds while it needs the plain form). oneDNN reorders its
        layout back to the plain one (a copy of every value, no arithmetic); the avx2
        layout is 16-column panels, [out/16][in][16]. ValueError for MKL's layout, which
        has no inverse."""
        if self.kernel == "onednn":
            return self.require_packed().to_dense()
        if self.kernel == "avx2":
            panel = cpu_sgemm.PANEL
            panels = self.require_packed().view(-1, self.in_features, panel).transpose(1, 2)
            return panels.reshape(-1, self.in_features)[: self.out_features].contiguous()
        raise ValueError("MKL's packed layout cannot be unpacked: its layer keeps the plain weight")

    def release(self) -> None:
        """Drop the packed data now, whoever still holds this object (a loader's table of
        parameters holds the replaced ones until it ends): its weight was unpacked into a
        new tensor, and this copy must not stay alive beside it. Using it then raises."""
        self.packed = None

    def require_packed(self) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("this packed weight was released: its layer holds the weight unpacked now "
                               "(read layer.weight again)")
        return self.packed

    def repack(self, weight: torch.Tensor) -> None:
        """Pack new values of the same shape in place of the old ones (converted to this
        layout's dtype); the old packed tensor is dropped once nobody holds it."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"cannot repack a {tuple(weight.shape)} weight into a "
                             f"{(self.out_features, self.in_features)} packed layout")
        self.packed = self._pack(weight.detach().to(self.dtype).contiguous())

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

    def linear(self, x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the plain tensor this was packed from, which MKL needs (its bookkeeping
        and its large batches, above PACKED_MAX_ROWS, run F.linear on it); None for the
        other kernels, which serve every row count. An input of another dtype, or with no
        rows, gets F.linear's result on the plain weight (unpacked for it if not given)."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or x.dtype != self.dtype:
            return F.linear(x, self.unpack() if weight is None else weight, bias)
        if self.kernel == "avx2":
            return self.sgemm.linear(x, self.packed, self.out_features, bias)
        if self.kernel == "onednn":
            return self._onednn_linear(x, bias)
        assert weight is not None, "MKL's packed product needs the plain weight beside it"
        if rows > PACKED_MAX_ROWS:
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, self.packed, weight, bias, rows)

    def linear_any_rows(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The packed product for every row count, with no unpacked weight needed (oneDNN
        and avx2 only, `holds_whole_weight`)."""
        assert self.holds_whole_weight
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.kernel == "avx2":
            return self.sgemm.linear(x, self.packed, self.out_features, bias)
        return self._onednn_linear(x, bias)

    def verify(self, weight: torch.Tensor | None = None) -> bool:
        """`layout_verified` for this kernel and weights of this one's shape and dtype
        (`weight`, if given, names them instead)."""
        shape = (self.out_features, self.in_features) if weight is None else tuple(weight.shape)
        return layout_verified(self.kernel, self.dtype if weight is None else weight.dtype, shape)


def layout_verified(kernel: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether `kernel`'s packed product matches F.linear for a few row counts on `dtype`
    weights of `shape`'s class: the packed layout being independent of the row count is
    library behaviour, not an API promise, so it is checked rather than assumed. The
    layout depends on the library, the CPU, the dtype and the shape class
    (`shape_class`) alone, so the check runs on a small random weight of that class,
    once per process: milliseconds, where checking each real weight took 1.5 s of a
    3.5 s load of a 1.34 GB bf16 llama here. Raises what packing raises (RuntimeError
    from a library that cannot pack `dtype`)."""
    key = (kernel, dtype, shape_class(shape))
    if key not in _VERIFIED:
        _VERIFIED[key] = _verify_layout(kernel, dtype, key[2])
    return _VERIFIED[key]


def _verify_layout(kernel: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Pack a random `shape` weight of `dtype` with `kernel` and compare its product with
    F.linear's in float32 at 1, 7 and _PACK_HINT_ROWS + 1 rows."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator).to(dtype)
    packed = PackedWeight(weight, kernel)
    # float32 kernels differ from F.linear only by reassociation; a half-precision one
    # also rounds its output, so it may be a unit in the last place off.
    rel = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for rows in (1, 7, _PACK_HINT_ROWS + 1):
        x = torch.randn(rows, shape[1], generator=generator).to(dtype)
        expected = F.linear(x.float(), weight.float())
        got = packed.linear(x, weight)  # at most PACKED_MAX_ROWS rows: packed, for every kernel
        tolerance = rel * (1.0 + expected.abs().max().item())
        if got.shape != expected.shape or not torch.allclose(got.float(), expected, rtol=rel, atol=tolerance):
            return False
    return True
