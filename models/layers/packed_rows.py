"""Rows of a packed weight, read where they lie: the embedding lookup of a tied LM head.

A tied LM head's weight is the embedding's table. Packed in place (models/layers/
unquantized.py), the table exists only in the GEMM's layout, so a lookup must read its
rows from there; unpacking the table per step would cost a full copy. Both layouts that
replace weights are blocked layouts in which an element's offset is the sum of a part
that depends on its row and a part that depends on its column, so `gather_rows` reads
rows with one index: the avx2 kernel's 16-row panels ([out/16][in][16]), and oneDNN's
blocked formats (AB16b64a2b for bf16 on the Zen 5 VM), described by the memory
descriptor oneDNN serialises for the packed tensor.

That descriptor's byte layout is oneDNN's own, not a documented API, so it is read
defensively (its dims must be the tensor's, its format blocked) and the decoding is
checked, like the packed product, once per (library, dtype, shape class) in a process on
a small random weight (`rows_readable`); where either fails, a tied LM head is not packed.
Called on the thread that runs the model; returns new tensors, holds nothing.
"""

from __future__ import annotations

import ctypes
import math
import struct

import torch

from models.layers.cpu_gemm import PackedWeight, shape_class
from models.layers.cpu_sgemm import PANEL

_MAX_DIMS = 12  # DNNL_MAX_NDIMS: each array of the serialised descriptor has this many slots
_BLOCKED = 2  # dnnl_blocked
_DESC_WORDS = 6 * _MAX_DIMS + 4
_VERIFIED: dict[tuple[str, torch.dtype, tuple[int, ...]], bool] = {}


def _onednn_offsets(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row offsets [out], column offsets [in]) in elements of a oneDNN packed [out, in]
    tensor, from its serialised memory descriptor; None where it is not as expected."""
    blob = bytes(torch.ops.mkldnn._get_mkldnn_serialized_md(packed).tolist())
    if len(blob) < 8 + 8 * _DESC_WORDS:
        return None
    ndims = struct.unpack_from("<i", blob, 4)[0]
    words = struct.unpack_from(f"<{_DESC_WORDS}q", blob, 8)
    m = _MAX_DIMS
    dims, offset0, kind = words[0:2], words[3 * m + 1], words[3 * m + 2]
    strides, nblks = words[3 * m + 3:3 * m + 5], words[4 * m + 3]
    if ndims != 2 or tuple(dims) != tuple(packed.shape) or kind != _BLOCKED or not 0 <= nblks <= m:
        return None
    blocks, block_dims = words[4 * m + 4:4 * m + 4 + nblks], words[5 * m + 4:5 * m + 4 + nblks]
    if any(d not in (0, 1) for d in block_dims) or any(b <= 0 for b in blocks):
        return None
    offsets = []
    for dim in (0, 1):
        mine = [i for i, d in enumerate(block_dims) if d == dim]
        inner = math.prod(blocks[i] for i in mine)
        coords = torch.arange(dims[dim])
        offset = coords // inner * strides[dim]
        later = inner
        for i in mine:  # the first block listed for a dimension is its most significant digit
            later //= blocks[i]
            offset += coords // later % blocks[i] * math.prod(blocks[i + 1:])
        offsets.append(offset)
    return offsets[0] + offset0, offsets[1]


def _offsets(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weight's row and column offsets, computed once per PackedWeight (they depend on
    its layout only, which a repack of the same shape keeps)."""
    if weight.row_index is None:
        weight.row_index = _layout_offsets(weight)
    return weight.row_index


def _layout_offsets(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    if weight.kernel == "avx2":
        rows = torch.arange(weight.out_features)
        return rows // PANEL * PANEL * weight.in_features + rows % PANEL, torch.arange(weight.in_features) * PANEL
    if weight.kernel == "onednn":
        return _onednn_offsets(weight.require_packed())
    return None


def gather_rows(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """`weight`'s rows `ids` ([..., in], the packed dtype), read from the packed layout;
    ValueError where the layout's rows cannot be read (MKL's, or a descriptor not as
    expected). Callers check `rows_readable` first."""
    offsets = _offsets(weight)
    if offsets is None:
        raise ValueError(f"the rows of a {weight.kernel} packed weight cannot be read in place")
    row_offsets, column_offsets = offsets
    packed = weight.require_packed()
    if packed.is_mkldnn:  # oneDNN's opaque tensor: a flat view of its bytes, alive as long as `packed`
        nbytes = int(torch.ops.mkldnn._nbytes(packed))
        raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
        flat = torch.frombuffer(raw, dtype=packed.dtype)
    else:
        flat = packed.reshape(-1)
    index = row_offsets[ids.reshape(-1)].unsqueeze(1) + column_offsets
    return flat[index].reshape(*ids.shape, weight.in_features)


def rows_readable(kernel: str, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether `gather_rows` reads `kernel`'s packed `dtype` weights of `shape`'s class
    exactly: checked on a small random weight of that class, once per process."""
    key = (kernel, dtype, shape_class(shape))
    if key not in _VERIFIED:
        weight = torch.randn(key[2], generator=torch.Generator().manual_seed(1)).to(dtype)
        try:
            packed = PackedWeight(weight, kernel)
            ids = torch.arange(weight.shape[0]).flip(0)
            _VERIFIED[key] = torch.equal(gather_rows(packed, ids), weight[ids])
        except (RuntimeError, ValueError, struct.error):
            _VERIFIED[key] = False
    return _VERIFIED[key]
