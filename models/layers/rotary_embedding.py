"""Rotary position embedding (neox style), plain or with llama3 frequency scaling.

On the CPU one C call rotates q and k (`cpu_ops.py`) where it can; elsewhere, and as its
fallback, torch ops with the same roundings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from models.layers import cpu_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute `positions` [T].

    The cos/sin table covers `max_position` positions, is computed in float32 and is a
    non-persistent buffer, so it never appears among the weights to load.
    """

    def __init__(
        self, head_size: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: 'default', 'llama3'")
        t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        self._cos_sin_cache: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_size / 2] cos and sin at `positions` (both halves of a head share
        them). One model's layers all share this module and the positions tensor of a
        step, so the lookup is kept for the next layer."""
        cached = self._cos_sin_cache
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            half = self.head_size // 2
            cos = self.cos_cached[positions, :half].to(dtype).unsqueeze(1)
            sin = self.sin_cached[positions, :half].to(dtype).unsqueeze(1)
            cached = self._cos_sin_cache = (positions, dtype, cos, sin)
        return cached[2], cached[3]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads * head_size], k: [T, num_kv_heads * head_size], rotated in
        place (they are fresh projection outputs) and returned.

        Per head, with halves x1, x2: (x1 cos - x2 sin, x2 cos + x1 sin), the HF
        `x * cos + rotate_half(x) * sin` with the same roundings. Raises IndexError for
        a position past the table (max_position).
        """
        kernel = cpu_ops.load() if q.device.type == "cpu" else None
        if kernel is not None and kernel.rotary_neox(q, k, self.head_size, positions, self.cos_cached,
                                                     self.sin_cached):
            return q, k
        cos, sin = self._cos_sin(positions, q.dtype)
        half = self.head_size // 2
        for x in (q, k):
            heads = x.view(x.shape[0], -1, self.head_size)
            x1, x2 = heads[..., :half], heads[..., half:]
            first = x1 * cos - x2 * sin
            x2.mul_(cos).add_(x1 * sin)
            x1.copy_(first)
        return q, k
