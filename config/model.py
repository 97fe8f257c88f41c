"""ModelConfig: what the model is, read from its config.json (or GGUF metadata).

`ModelConfig.from_hf_config` is pure: the engine's resolution step
(`engine/arg_utils.py`) reads the file and passes its parsed contents here. Every check
raises ConfigError naming the source file, the field and its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from config.utils import ConfigError

if TYPE_CHECKING:
    import torch

# dtype names as EngineConfig(dtype=...), vLLM's --dtype and config.json's torch_dtype
# spell them -> torch's name. Names, not torch.dtype objects: importing the config must
# not import torch (the CLI parses its flags without it).
DTYPES: dict[str, str] = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in DTYPES."""
    import torch

    return getattr(torch, DTYPES[name])

# Fields every supported architecture reads, and optional ones checked when present.
_REQUIRED_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
# Architectures whose models give their attention layers the config's `sliding_window`
# (every layer, or those `layer_types` marks as sliding). Any other architecture with a
# window shorter than max_model_len is refused rather than run without its window.
SLIDING_WINDOW_ARCHITECTURES = frozenset({"MistralForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM",
                                          "Gemma3ForCausalLM",
                                          "Phi3ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
                                          "Qwen3MoeForCausalLM"})
# Larger than any real model's dimension, small enough that no allocation sized by it is attempted.
_MAX_DIM = (1 << 31) - 1


def check_hf_config(hf_config: SimpleNamespace, source: Path) -> None:
    """Refuse a model config that no model could be built from, before any worker
    starts: ConfigError naming `source` (config.json or the GGUF file), the field and
    its value. Required: `architectures` (a non-empty list of names) and the integer
    dimensions in `_REQUIRED_INT_FIELDS`; every dimension is an integer in [1, 2**31 - 1]
    (not a bool or float); the attention heads split evenly (num_key_value_heads divides
    num_attention_heads; without an explicit head_dim, num_attention_heads divides
    hidden_size); rope_theta and rms_norm_eps, when set, are positive numbers."""
    archs = getattr(hf_config, "architectures", None)
    if archs is None:
        raise ConfigError(f"{source} lacks the required key 'architectures'")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
        raise ConfigError(f"{source}: architectures={archs!r} must be a non-empty list of architecture names")
    for key in _REQUIRED_INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(hf_config, key, None)
        if value is None:
            if key in _REQUIRED_INT_FIELDS:
                raise ConfigError(f"{source} lacks the required key {key!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}={value!r} must be an integer")
        if not 1 <= value <= _MAX_DIM:
            raise ConfigError(f"{source}: {key}={value!r} must be between 1 and {_MAX_DIM}")
    heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
        )
    if getattr(hf_config, "head_dim", None) is None and hidden % heads:
        raise ConfigError(
            f"{source}: num_attention_heads={heads} does not divide hidden_size={hidden} (and no head_dim is given)"
        )
    for key in ("rope_theta", "rms_norm_eps"):
        value = getattr(hf_config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ConfigError(f"{source}: {key}={value!r} must be a positive number")


@dataclass
class ModelConfig:
    model: str  # a local directory (a Hub id was resolved by the engine before workers start)
    dtype: torch.dtype
    hf_config: SimpleNamespace
    max_model_len: int
    seed: int = 0
    revision: str | None = None
    quantization: str | None = None

    @classmethod
    def from_hf_config(cls, model: str, hf_config: SimpleNamespace, source: Path, *, dtype: str,
                       max_model_len: int | None, seed: int, revision: str | None,
                       quantization: str | None) -> ModelConfig:
        """Check `hf_config` (parsed from `source`) and derive the dtype ("auto": the
        checkpoint's torch_dtype, float32 when it names none) and max_model_len (None:
        the model's max_position_embeddings, 2048 when absent). Raises ConfigError."""
        check_hf_config(hf_config, source)
        if dtype == "auto":
            ckpt_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or "float32"
            if not isinstance(ckpt_dtype, str) or ckpt_dtype not in DTYPES:
                raise ConfigError(f"{source}: torch_dtype={ckpt_dtype!r} is not one of {list(DTYPES)}")
            resolved_dtype = torch_dtype(ckpt_dtype)
        else:
            resolved_dtype = torch_dtype(dtype)
        max_positions = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_len = max_model_len if max_model_len is not None else max_positions
        if max_len < 2:
            raise ConfigError(f"max_model_len={max_len!r} must be >= 2 (one prompt token and one generated token)")
        if max_len > max_positions:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings={max_positions}"
            )
        window = getattr(hf_config, "sliding_window", None)
        archs = getattr(hf_config, "architectures", None) or []
        if (window is not None and getattr(hf_config, "use_sliding_window", True) and window < max_len
                and not set(archs) <= SLIDING_WINDOW_ARCHITECTURES):
            raise ConfigError(
                f"sliding_window={window} in {source} is shorter than max_model_len={max_len}; "
                f"sliding-window attention is implemented for {sorted(SLIDING_WINDOW_ARCHITECTURES)}, "
                f"not architectures={archs}: set max_model_len <= the window"
            )
        return cls(model, resolved_dtype, hf_config, max_len, seed, revision, quantization)

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size
