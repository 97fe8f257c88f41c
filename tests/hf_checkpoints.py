"""Tiny random checkpoints written by transformers itself, and the comparisons against it.

For the architectures whose checkpoints `engine.tiny_model` does not write (Qwen3,
Phi-3, ...): the test builds a transformers config, `save_random_checkpoint` writes the
model transformers makes from it, and the engine's outputs are compared with
transformers' greedy `generate` (tests/test_generation.py's `hf_greedy`) and with its
full-prompt forward (`hf_prompt_logprobs`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

LOGPROBS_ATOL = 1e-4


def save_random_checkpoint(config: Any, out_dir: Path, seed: int, init_std: float = 0.1) -> Path:
    """Save transformers' model for `config` (float32 safetensors, config.json naming the
    architecture) with weights and biases N(0, init_std) and norm weights 1 + 0.1 N(0, 1):
    attention far from uniform, and norm weights that are not all ones, so a mistake in
    RoPE, head layout or which norm weight goes where changes the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied LM head is listed once
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, init_std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def hf_prompt_logprobs(hf: Any, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole prompt in one forward pass:
    row i is the distribution of prompt token i + 1. [len(prompt) - 1, vocab]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_logprobs_match(got: list[dict[int, float] | None], ref: torch.Tensor, chosen: list[int], top: int,
                          where: str, atol: float = LOGPROBS_ATOL) -> None:
    """Each step's returned logprobs hold exactly the reference's top `top` plus the chosen
    token, each within `atol` of the reference's [steps, vocab] log-probabilities."""
    assert len(got) == ref.shape[0] == len(chosen), where
    for step, (entry, token) in enumerate(zip(got, chosen)):
        assert entry is not None, f"{where}, step {step}"
        expected = set(torch.topk(ref[step], top).indices.tolist()) | {token}
        assert set(entry) == expected, f"{where}, step {step}"
        for tok, value in entry.items():
            assert value == pytest.approx(float(ref[step, tok]), abs=atol), f"{where}, step {step}, token {tok}"
