"""Tiny Mistral and Qwen2 checkpoints with a sliding window, and transformers' model of
them with any window, shared by the sliding-window tests (tests/test_sliding_window.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.tiny_model import make_tiny_model

WINDOW = 8
_MODELS: dict[str, Path] = {}


def _windowed_model(tmp_path_factory: pytest.TempPathFactory, arch: str, num_layers: int, seed: int,
                    **config_fields: object) -> Path:
    """Written once per session: hidden 64, 4 heads / 2 kv heads, vocab 320, init_std 0.1
    (attention far from uniform), with `config_fields` set in config.json."""
    if arch not in _MODELS:
        model_dir = make_tiny_model(tmp_path_factory.mktemp(f"{arch}_window"), arch=arch, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=320, seed=seed, init_std=0.1,
                                    with_tokenizer=False)
        config_path = model_dir / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("layer_types", None)
        config.update(config_fields)
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        _MODELS[arch] = model_dir
    return _MODELS[arch]


def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Mistral whose config.json's sliding_window is 8 (every layer)."""
    return _windowed_model(tmp_path_factory, "mistral", 2, 11, sliding_window=WINDOW)


def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer Qwen2 (q/k/v biases) with `use_sliding_window`, `sliding_window` = 8 and
    `max_window_layers` = 1: layer 0 full, layers 1 and 2 windowed, as transformers
    derives it (no `layer_types` written)."""
    return _windowed_model(tmp_path_factory, "qwen2", 3, 12, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1)


def hf_with_window(model_dir: Path, window: int | None) -> Any:
    """transformers' float32 model of `model_dir` with `sliding_window` set to `window`
    (None: full attention) on the layers its config makes sliding, eos disabled (the
    engine runs with ignore_eos)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    config.sliding_window = window
    if window is None and getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    return hf
