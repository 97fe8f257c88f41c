"""GGUF block formats: their sizes, and plain-torch dequantisers for them.

The formats are llama.cpp's (ggml-common.h; the layouts are spelled out in
gguf_kernels.c). `GGUF_FORMATS` names the ones held quantised (`GGUFLinearMethod`,
`GGUFEmbeddingMethod`) and the float types a GGUF layer may hold beside them.

`dequantize(qtype, blocks, k)` is the portable path (dequantise, then a matmul, per
call): CUDA without the triton package, and the CPU where the C kernels cannot be built;
and the lookups of embedding rows on CUDA. It runs on the tensor's
device and computes each value in the order gguf-py does, so on the CPU its float32
values equal gguf-py's and the C kernel's bit for bit. Memory: a few temporaries of the
output's size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class GGUFFormat(NamedTuple):
    type_id: int      # ggml's GGMLQuantizationType value
    block_size: int   # values per block
    block_bytes: int  # bytes per block


#: Formats held as blocks; F32/F16/BF16 are held as their raw values (one-value "blocks").
GGUF_FORMATS: dict[str, GGUFFormat] = {
    "F32": GGUFFormat(0, 1, 4),
    "F16": GGUFFormat(1, 1, 2),
    "BF16": GGUFFormat(30, 1, 2),
    "Q4_0": GGUFFormat(2, 32, 18),
    "Q8_0": GGUFFormat(8, 32, 34),
    "Q4_K": GGUFFormat(12, 256, 144),
    "Q5_K": GGUFFormat(13, 256, 176),
    "Q6_K": GGUFFormat(14, 256, 210),
}
FLOAT_TYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANTIZED_TYPES: tuple[str, ...] = tuple(t for t in GGUF_FORMATS if t not in FLOAT_TYPES)


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of `k` values; raises ValueError when k is not whole blocks."""
    fmt = GGUF_FORMATS[qtype]
    if k % fmt.block_size:
        raise ValueError(f"a row of {k} values is not a whole number of {qtype} blocks of {fmt.block_size}")
    return k // fmt.block_size * fmt.block_bytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32 (fp16 little-endian)."""
    return b.contiguous().view(torch.float16).float()


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-quants' eight 6-bit (scale, min) pairs from their 12 bytes: [n, 12] -> [n, 8] x2."""
    s = s.to(torch.int32)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc.float(), mn.float()


def _nibbles_k(q: torch.Tensor) -> torch.Tensor:
    """[n, 128] packed nibbles -> [n, 8, 32]: each 32 bytes give 32 low then 32 high nibbles."""
    q = q.to(torch.int32).reshape(-1, 4, 1, 32)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(-1, 8, 32)


def _dequantize_blocks(qtype: str, b: torch.Tensor) -> torch.Tensor:
    """[n_blocks, block_bytes] uint8 -> [n_blocks, block_size] float32."""
    if qtype == "Q8_0":
        return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()
    if qtype == "Q4_0":
        qs = b[:, 2:].to(torch.int32)
        return _f16(b[:, :2]) * (torch.cat([qs & 15, qs >> 4], dim=1) - 8).float()
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _scale_min_k4(b[:, 4:16])
        q = _nibbles_k(b[:, 16:144] if qtype == "Q4_K" else b[:, 48:176])
        if qtype == "Q5_K":  # the fifth bit of value l of sub-block j is bit j of qh[l]
            qh = b[:, 16:48].to(torch.int32).unsqueeze(1)
            shifts = torch.arange(8, device=b.device, dtype=torch.int32).view(1, 8, 1)
            q = q | (((qh >> shifts) & 1) << 4)
        return ((d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)).reshape(-1, 256)
    if qtype == "Q6_K":
        ql = b[:, 0:128].to(torch.int32).reshape(-1, 2, 2, 32)   # [n, half, ql+0 / ql+32, l]
        qh = b[:, 128:192].to(torch.int32).reshape(-1, 2, 1, 32)  # [n, half, 1, l]
        scales = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 4, 2)  # [n, half, quarter, l//16]
        d = _f16(b[:, 208:210]).view(-1, 1, 1, 1)
        low = torch.cat([ql & 15, ql >> 4], dim=2)  # quarters 0..3: ql[l]&15, ql[l+32]&15, ql[l]>>4, ql[l+32]>>4
        shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.int32).view(1, 1, 4, 1)
        q = (low | (((qh >> shifts) & 3) << 4)) - 32  # [n, half, quarter, 32]
        ds = (d * scales).repeat_interleave(16, dim=-1)  # [n, half, quarter, 32]
        return (ds * q.float()).reshape(-1, 256)
    raise ValueError(f"no dequantiser for GGUF type {qtype}")


def dequantize(qtype: str, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of `k` values held as `qtype` ([rows, row_bytes] uint8) -> [rows, k] float32,
    on the tensor's device. F32/F16/BF16 rows are their raw values."""
    rows = blocks.shape[0]
    if qtype in FLOAT_TYPES:
        return blocks.contiguous().view(FLOAT_TYPES[qtype]).reshape(rows, k).float()
    fmt = GGUF_FORMATS[qtype]
    return _dequantize_blocks(qtype, blocks.reshape(-1, fmt.block_bytes)).reshape(rows, k)
