"""A tiny Mistral checkpoint with a sliding window, and transformers' model of it with
any window, shared by the sliding-window tests (tests/test_sliding_window.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.tiny_model import make_tiny_model

WINDOW = 8
_MODELS: dict[str, Path] = {}


def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Written once per session: hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 320,
    init_std 0.1 (attention far from uniform), and config.json's sliding_window = 8."""
    if "mistral" not in _MODELS:
        model_dir = make_tiny_model(tmp_path_factory.mktemp("mistral_window"), arch="mistral", hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=320, seed=11, init_std=0.1,
                                    with_tokenizer=False)
        config_path = model_dir / "config.json"
        config = json.loads(config_path.read_text())
        config["sliding_window"] = WINDOW
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        _MODELS["mistral"] = model_dir
    return _MODELS["mistral"]


def hf_with_window(model_dir: Path, window: int | None) -> Any:
    """transformers' float32 model of `model_dir` with `sliding_window` set to `window`
    (None: full attention), eos disabled (the engine runs with ignore_eos)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    config.sliding_window = window
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    return hf
