"""Mistral: the Llama layout. Sliding-window attention is not implemented, so a
checkpoint whose window is shorter than max_model_len is refused by ModelConfig."""

from __future__ import annotations

from models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
