"""Mixtral: Llama attention, and a sparse mixture of experts in every layer.

Checkpoint names: `model.layers.N.block_sparse_moe.gate.weight` (the router,
[num_local_experts, hidden]) and `...block_sparse_moe.experts.M.w1|w2|w3.weight` (gate,
down, up). The router keeps the top `num_experts_per_tok` experts and always
renormalises their weights (a softmax over the kept logits). `sliding_window` (None in
Mixtral's releases) applies to every layer. Tensor or expert parallelism as in
models/layers/fused_moe/layer.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

from torch import nn

from models.layers.rotary_embedding import RotaryEmbedding
from models.llama import LlamaAttention
from models.moe_utils import MoEDecoderLayer, MoEForCausalLM, MoEModel, SparseMoeBlock


class MixtralForCausalLM(MoEForCausalLM):
    expert_proj_to_shard: ClassVar[dict[str, str]] = {"w1": "w1", "w2": "w2", "w3": "w3"}
    num_experts_fields = ("num_local_experts",)
    ffn_name = "block_sparse_moe"
    checkpoint_proj_names = ("w1", "w3", "w2")

    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        def make_layer(layer_idx: int, rotary_emb: RotaryEmbedding, window: int | None) -> nn.Module:
            moe = SparseMoeBlock(hf_config.hidden_size, self.num_experts(hf_config), hf_config.num_experts_per_tok,
                                 hf_config.intermediate_size, renormalize=True,
                                 enable_expert_parallel=self.enable_expert_parallel,
                                 checkpoint_proj_names=self.checkpoint_proj_names)
            attn = LlamaAttention(hf_config, False, rotary_emb, window)
            return MoEDecoderLayer(hf_config, attn, moe, self.ffn_name)

        return MoEModel(hf_config, max_positions, make_layer, getattr(hf_config, "sliding_window", None))
