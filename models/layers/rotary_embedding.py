"""Rotary position embedding (neox style): plain, with linear (position interpolation) or
llama3 frequency scaling, or with LongRoPE (Phi-3); over the whole head or, with `partial_rotary_factor`, its first
`rotary_dim` features.

On the CPU one C call rotates q and k (`cpu_ops.py`) where it can (full-head rotary);
elsewhere, and as its fallback, torch ops with the same roundings. `forward_after_qk_norm`
takes Qwen3's per-head q/k norms into the same call.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from config.utils import ConfigError
from models.layers import cpu_ops
from models.layers.layernorm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_settings(hf_config: SimpleNamespace) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic keys or transformers v5's `rope_parameters`."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta", 10000.0)
    scaling = getattr(hf_config, "rope_scaling", None) or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    """The scaling's type ("rope_type", or the older "type"); "su" is LongRoPE's old name."""
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type")) or "default"
    return "longrope" if rope_type == "su" else rope_type


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


def _longrope_inv_freq(
    base: float, rotary_dim: int, max_position: int, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of LongRoPE, with transformers' numbers
    (`_compute_longrope_parameters`): inv_freq = 1 / (ext * base^(2i/d)), cos and sin
    scaled by sqrt(1 + ln(factor) / ln(original)) (or the given `attention_factor`), where
    factor defaults to max_position_embeddings / original_max_position_embeddings.

    Which factor list: transformers re-derives the frequencies per forward pass, long
    ones when the pass reaches past `original_max_position_embeddings`, so a cached
    sequence that grows past it mixes both. Like vLLM, we choose once per engine: the
    long factors iff `max_position` (max_model_len) exceeds the original length. The
    rotation then depends on the position only (prefix caching and chunked prefill stay
    exact), matches transformers exactly for every sequence when max_model_len <= the
    original length, and for sequences longer than it otherwise; set max_model_len <=
    original_max_position_embeddings to get the short factors."""
    original = int(scaling["original_max_position_embeddings"])
    which = "long_factor" if max_position > original else "short_factor"
    ext = scaling.get(which)
    if not isinstance(ext, (list, tuple)) or len(ext) != rotary_dim // 2:
        raise ConfigError(f"rope_scaling[{which!r}] must be a list of rotary_dim / 2 = {rotary_dim // 2} numbers, "
                         f"got {ext!r}")
    factor = scaling.get("factor") or float(scaling["max_position_embeddings"]) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponent), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first `rotary_dim` (default: all) features of each q and k head
    given absolute `positions` [T].

    The cos/sin table covers `max_position` positions, is computed in float32 (LongRoPE's
    attention factor folded in) and is a non-persistent buffer, so it never appears among
    the weights to load. Raises ConfigError (a ValueError) naming an unknown `rope_scaling` type or a
    malformed LongRoPE factor list.
    """

    def __init__(
        self,
        head_size: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        dim = self.rotary_dim
        rope_type = rope_type_of(rope_scaling)
        attention_factor = 1.0
        if rope_type == "longrope":
            inv_freq, attention_factor = _longrope_inv_freq(base, dim, max_position, rope_scaling or {})
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
        elif rope_type == "linear":  # positions divided by the factor, as transformers divides inv_freq
            factor = (rope_scaling or {}).get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                raise ConfigError(f"rope_scaling factor={factor!r} must be a positive number for rope_type 'linear'")
            inv_freq = inv_freq / float(factor)
        elif rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                             f"{', '.join(repr(t) for t in SUPPORTED_ROPE_TYPES)}")
        t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)
        self._cos_sin_cache: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim / 2] cos and sin at `positions` (both halves of a head share
        them). One model's layers all share this module and the positions tensor of a
        step, so the lookup is kept for the next layer."""
        cached = self._cos_sin_cache
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            half = self.rotary_dim // 2
            cos = self.cos_cached[positions, :half].to(dtype).unsqueeze(1)
            sin = self.sin_cached[positions, :half].to(dtype).unsqueeze(1)
            cached = self._cos_sin_cache = (positions, dtype, cos, sin)
        return cached[2], cached[3]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads * head_size], k: [T, num_kv_heads * head_size], rotated in
        place (they are fresh projection outputs) and returned.

        Per head, with halves x1, x2 of its first rotary_dim features: (x1 cos - x2 sin,
        x2 cos + x1 sin), the HF `x * cos + rotate_half(x) * sin` with the same roundings;
        the features past rotary_dim pass through. Raises IndexError for a position past
        the table (max_position).
        """
        # The C kernel rotates whole heads; a partial rotary takes the torch ops.
        kernel = cpu_ops.load() if q.device.type == "cpu" and self.rotary_dim == self.head_size else None
        if kernel is not None and kernel.rotary_neox(q, k, self.head_size, positions, self.cos_cached,
                                                     self.sin_cached):
            return q, k
        cos, sin = self._cos_sin(positions, q.dtype)
        half = self.rotary_dim // 2
        for x in (q, k):
            heads = x.view(x.shape[0], -1, self.head_size)
            x1, x2 = heads[..., :half], heads[..., half:self.rotary_dim]
            first = x1 * cos - x2 * sin
            x2.mul_(cos).add_(x1 * sin)
            x1.copy_(first)
        return q, k

    def forward_after_qk_norm(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm,
                              k_norm: RMSNorm, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's attention inputs: each head of q [T, Hq * head_size] normalised by
        `q_norm` and each of k's by `k_norm` (over head_size), then rotated as `forward`
        rotates. On the CPU one C call does it in place (vLLM's fused_qk_norm_rope: no copy
        of the strided q/k views, three calls fewer a layer), each head's values exactly
        the unfused path's; otherwise the norms on a copy of one row per head, then
        `forward`. Raises IndexError for a position past the table (max_model_len)."""
        kernel = (cpu_ops.load() if q.device.type == "cpu" and self.rotary_dim == self.head_size == head_size
                  and q_norm.eps == k_norm.eps else None)
        if kernel is not None and kernel.qk_norm_rope(q, k, head_size, q_norm.weight, k_norm.weight, q_norm.eps,
                                                      positions, self.cos_cached, self.sin_cached):
            return q, k
        q = q_norm(q.reshape(-1, head_size)).view(q.shape)
        k = k_norm(k.reshape(-1, head_size)).view(k.shape)
        return self.forward(positions, q, k)


def get_rope(hf_config: SimpleNamespace, head_size: int, max_position: int) -> RotaryEmbedding:
    """The model's RotaryEmbedding from its config.json: rope_theta and rope_scaling (classic
    keys or v5 `rope_parameters`), `partial_rotary_factor` (top level or in the rope
    parameters), and for LongRoPE the top-level original/max position embeddings when the
    scaling dict lacks them (Phi-3's older configs). `max_position` is max_model_len.
    Raises ConfigError naming an unsupported scaling type or a missing LongRoPE field."""
    base, scaling = rope_settings(hf_config)
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = getattr(hf_config, "partial_rotary_factor", None) or params.get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_size * float(factor))
    if rope_type_of(scaling) == "longrope":
        scaling = dict(scaling or {})
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if scaling.get(key) is None:
                scaling[key] = getattr(hf_config, key, None)
            if scaling[key] is None:
                raise ConfigError(f"rope_scaling type 'longrope' needs {key}, which the config lacks")
    return RotaryEmbedding(head_size, max_position, base, scaling, rotary_dim)
