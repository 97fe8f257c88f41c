"""Test-only GGUF quantisers for the K-quants, which gguf-py 0.19 can read but not write.

They follow llama.cpp's block layouts (ggml-common.h) and produce valid, reasonably
accurate blocks (not llama.cpp's error-minimising search): per sub-block a scale (and
for Q4_K/Q5_K a min) from the range, then the 6-bit (or int8) scales quantised against
the block's fp16 super-scale. Their output is checked against `gguf.quants.dequantize`
(tests/test_gguf_quantised.py), the independent reader.

`quantize(data, qtype)` takes [rows, k] float32 (k a multiple of 256) and returns
[rows, row_bytes] uint8, as `gguf.quants.quantize` does for Q4_0/Q8_0 (which it
delegates to for those).
"""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [n, 2], the fp16 value as float32 [n, 1])."""
    h = x.astype(np.float16).reshape(-1, 1)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit (scale, min) pairs per block [n, 8] -> the 12 packed bytes [n, 12]."""
    s = np.zeros((sc.shape[0], 12), np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return s


def _quantize_k_minmax(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: x [n, 256] -> (header bytes [n, 16]: d, dmin, scales; q [n, 8, 32] in
    [0, levels]; nothing else)."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # value = scale * q - min, min >= 0
    hi = sub.max(axis=2)
    scale = (hi - lo) / levels
    d_bytes, d = _f16(scale.max(axis=1) / 63)
    dmin_bytes, dmin = _f16((-lo).max(axis=1) / 63)
    sc = np.clip(np.rint(_safe_div(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin)), 0, 63).astype(np.uint8)
    eff_scale = (d * sc.astype(np.float32))[..., None]
    eff_min = (dmin * mn.astype(np.float32))[..., None]
    q = np.clip(np.rint(_safe_div(sub + eff_min, eff_scale)), 0, levels).astype(np.uint8)
    header = np.concatenate([d_bytes, dmin_bytes, _pack_scale_min(sc, mn)], axis=1)
    return header, q, sub


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] (4 bits) -> [n, 128]: each 64 values as 32 bytes, low nibbles first."""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    header, q, _ = _quantize_k_minmax(x, 15)
    return np.concatenate([header, _pack_nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    header, q, _ = _quantize_k_minmax(x, 31)
    # The fifth bit of value l of sub-block j is bit j of qh[l].
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    return np.concatenate([header, qh, _pack_nibbles(q & 15)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    amax_idx = np.abs(sub).argmax(axis=2)
    peak = np.take_along_axis(sub, amax_idx[..., None], axis=2)[..., 0]
    scale = -peak / 32  # q in [-32, 31]: the peak maps to -32, as llama.cpp does
    d_bytes, d = _f16(np.abs(scale).max(axis=1) / 127)
    sc = np.clip(np.rint(_safe_div(scale, d)), -128, 127).astype(np.int8)
    eff = (d * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(_safe_div(sub, eff)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8), d_bytes], axis=1)


_K_QUANTISERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """[rows, k] float -> [rows, row_bytes] uint8 blocks of `qtype`."""
    if qtype not in _K_QUANTISERS:
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype])
    rows, k = data.shape
    assert k % QK_K == 0, f"{qtype} rows must be whole blocks of {QK_K}, not {k}"
    blocks = _K_QUANTISERS[qtype](np.ascontiguousarray(data, dtype=np.float32).reshape(-1, QK_K))
    return np.ascontiguousarray(blocks).reshape(rows, -1)
