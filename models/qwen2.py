"""Qwen2: the Llama layout with biases on q/k/v. Small Qwen2 checkpoints tie the LM head
to the embedding (`tie_word_embeddings`); like transformers, an absent key means untied."""

from __future__ import annotations

from models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
