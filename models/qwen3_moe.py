"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) and sparse or dense feed-forwards.

Layer i is sparse (a `SparseMoeBlock` at `model.layers.i.mlp`: the router `mlp.gate`
and the experts `mlp.experts.M.gate_proj|up_proj|down_proj`) when i is not in
`mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`; otherwise a dense
MLP of `intermediate_size`. Experts are `moe_intermediate_size` wide. The router takes
the softmax over all `num_experts` and keeps the top `num_experts_per_tok`,
renormalised only when `norm_topk_prob`. With `use_sliding_window` every layer is
windowed (transformers' Qwen3-MoE has no per-layer types). Tensor or expert
parallelism as in models/layers/fused_moe/layer.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

from torch import nn

from models.layers.rotary_embedding import RotaryEmbedding
from models.llama import LlamaMLP
from models.moe_utils import MoEDecoderLayer, MoEForCausalLM, MoEModel, SparseMoeBlock
from models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoEForCausalLM):
    expert_proj_to_shard: ClassVar[dict[str, str]] = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    # Hub configs name it num_experts; transformers v5 writes num_local_experts.
    num_experts_fields = ("num_experts", "num_local_experts")

    @classmethod
    def is_sparse_layer(cls, hf_config: SimpleNamespace, layer_idx: int) -> bool:
        """transformers' rule for Qwen3-MoE: which layers hold experts."""
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        return layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0

    def build_model(self, hf_config: SimpleNamespace, max_positions: int) -> nn.Module:
        qkv_bias = bool(getattr(hf_config, "attention_bias", False))

        def make_layer(layer_idx: int, rotary_emb: RotaryEmbedding, window: int | None) -> nn.Module:
            ffn: nn.Module
            if self.is_sparse_layer(hf_config, layer_idx):
                ffn = SparseMoeBlock(hf_config.hidden_size, self.num_experts(hf_config),
                                     hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                                     renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
                                     enable_expert_parallel=self.enable_expert_parallel)
            else:
                ffn = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size)
            return MoEDecoderLayer(hf_config, Qwen3Attention(hf_config, qkv_bias, rotary_emb, window), ffn,
                                   self.ffn_name)

        window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", False) else None
        return MoEModel(hf_config, max_positions, make_layer, window)
