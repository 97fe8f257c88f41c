"""What the mixture-of-experts architectures share: the sparse block, the decoder stack,
expert weight routing and the expert-parallel name filter.

`MixtralForCausalLM` (models/mixtral.py) and `Qwen3MoeForCausalLM`
(models/qwen3_moe.py) are Llama-shaped decoders whose feed-forward is, in some or all
layers, a `SparseMoeBlock`: a replicated router (`gate`) and a `FusedMoE` (`experts`).
Built on every rank inside the model loader's build; under expert parallelism
(`config.parallel_config.enable_expert_parallel`) each rank builds only its experts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable

import torch
from torch import nn

from models.layers.fused_moe import ExpertPlacement, ExpertWeightsLoader, FusedMoE, determine_expert_placement
from models.layers.layernorm import RMSNorm
from models.layers.linear import ReplicatedLinear
from models.layers.quantization import get_quantization_config
from models.layers.rotary_embedding import RotaryEmbedding, get_rope
from models.layers.vocab_parallel_embedding import VocabParallelEmbedding
from models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim
from models.utils import AutoWeightsLoader

if TYPE_CHECKING:
    from config import EngineConfig


def check_expert_quantization(hf_config: SimpleNamespace, expert_names: list[list[str]]) -> None:
    """Refuse a checkpoint whose config.json declares a quantised format its experts
    cannot be read in (see `QuantizationConfig.moe_unsupported_reason`; `expert_names`:
    `MoEForCausalLM.expert_checkpoint_names`): they would be read as if they were plain
    weights. ValueError names the field."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    config = get_quantization_config(method, quant) if isinstance(quant, dict) and isinstance(method, str) else None
    reason = config.moe_unsupported_reason(expert_names) if config is not None else "no quantisation method reads it"
    if reason is not None:
        raise ValueError(f"quantization_config.quant_method={method!r} in config.json: this quantised "
                         f"mixture-of-experts checkpoint is not supported: {reason}")


class SparseMoeBlock(nn.Module):
    """`gate` (router logits, replicated on every rank) and `experts` (FusedMoE). Returns
    this rank's partial sum; the next norm all-reduces it, as after a dense MLP."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, enable_expert_parallel: bool,
                 checkpoint_proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        super().__init__()
        # The router stays in full precision whatever the checkpoint's quantisation, as vLLM
        # builds it (GPTQ and AWQ MoE checkpoints keep it float16 without naming it).
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, skip_quantization=True)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                enable_expert_parallel=enable_expert_parallel, reduce_results=False,
                                checkpoint_proj_names=checkpoint_proj_names)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MoEDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer's forward around a given attention and feed-forward module;
    the latter is registered under the checkpoint's name (`ffn_name`: "mlp", or
    Mixtral's "block_sparse_moe") and reached by the forward as `self.mlp`."""

    def __init__(self, hf_config: SimpleNamespace, self_attn: nn.Module, ffn: nn.Module, ffn_name: str) -> None:
        nn.Module.__init__(self)  # not Llama's: it would allocate a dense MLP we replace
        self.self_attn = self_attn
        self.ffn_name = ffn_name
        setattr(self, ffn_name, ffn)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    @property
    def mlp(self) -> nn.Module:  # type: ignore[override]
        return self._modules[self.ffn_name]


class MoEModel(LlamaModel):
    """LlamaModel's forward over layers built by `make_layer(layer_idx, rotary_emb,
    sliding_window)`; every layer gets `sliding_window`, dropped (as LlamaModel does)
    when it covers max_positions and so masks nothing."""

    def __init__(self, hf_config: SimpleNamespace, max_positions: int,
                 make_layer: Callable[[int, RotaryEmbedding, int | None], nn.Module],
                 sliding_window: int | None = None) -> None:
        nn.Module.__init__(self)  # not Llama's: it would allocate dense layers we replace
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, reduce_results=False)
        rotary_emb = get_rope(hf_config, head_dim(hf_config), max_positions)
        window = sliding_window if sliding_window is not None and sliding_window < max_positions else None
        self.layers = nn.ModuleList(make_layer(i, rotary_emb, window) for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)


class MoEForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface; subclasses build the decoder (`build_model`) and
    name their checkpoint's expert projections (`expert_proj_to_shard`)."""

    expert_proj_to_shard: ClassVar[dict[str, str]] = {}
    num_experts_fields: tuple[str, ...] = ("num_local_experts",)  # the first one config.json has
    #: The sparse block's checkpoint name in a decoder layer, and its experts' (gate, up,
    #: down) projection names: `model.layers.N.<ffn_name>.experts.M.<proj>`.
    ffn_name: ClassVar[str] = "mlp"
    checkpoint_proj_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: EngineConfig, prefix: str = "") -> None:
        hf_config = config.model_config.hf_config
        check_expert_quantization(hf_config, self.expert_checkpoint_names(hf_config))
        # Read by build_model, which the base __init__ calls (plain values may be set on a
        # Module before its __init__). The placement raises now if E does not split.
        self.enable_expert_parallel = bool(config.parallel_config.enable_expert_parallel)
        self.expert_placement: ExpertPlacement = determine_expert_placement(
            self.num_experts(hf_config), self.enable_expert_parallel)
        super().__init__(config, prefix)

    @classmethod
    def num_experts(cls, hf_config: SimpleNamespace) -> int:
        field = next((f for f in cls.num_experts_fields if getattr(hf_config, f, None) is not None),
                     cls.num_experts_fields[0])
        value = getattr(hf_config, field, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field}={value!r} in config.json must be a positive integer")
        return value

    @classmethod
    def is_sparse_layer(cls, hf_config: SimpleNamespace, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` holds experts (every one unless overridden)."""
        return True

    @classmethod
    def expert_checkpoint_names(cls, hf_config: SimpleNamespace) -> list[list[str]]:
        """Expert 0's (gate, up, down) checkpoint module names in each sparse layer: the
        names the model loader later resolves each FusedMoE's method by (compressed-
        tensors' targets and `ignore`), known from config.json alone, so the engine can
        judge the experts' quantisation at resolution (engine/arg_utils.py)."""
        return [[f"model.layers.{i}.{cls.ffn_name}.experts.0.{proj}" for proj in cls.checkpoint_proj_names]
                for i in range(hf_config.num_hidden_layers) if cls.is_sparse_layer(hf_config, i)]

    def is_local_checkpoint_tensor(self, name: str) -> bool:
        """The model loader's name filter: False for another rank's expert tensors under
        expert parallelism, which are then never read (model_loader/default_loader.py)."""
        return self.expert_placement.is_local_checkpoint_tensor(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Per-expert tensors into the FusedMoE layers, the rest as LlamaForCausalLM
        loads them; raises WeightLoadError naming any missing expert tensor."""
        loader = MoEWeightsLoader(
            self,
            ExpertWeightsLoader(self, self.expert_proj_to_shard),
            skip_prefixes=["lm_head."] if self.tie_word_embeddings else None,
            skip_substrs=["rotary_emb.inv_freq"],
        )
        return loader.load_weights(weights)


class MoEWeightsLoader(AutoWeightsLoader):
    """AutoWeightsLoader whose stream passes through `experts.route` first, so that the
    stacked expert parameters count as loaded in its own checks and error messages."""

    def __init__(self, module: nn.Module, experts: ExpertWeightsLoader, **kwargs: list[str] | None) -> None:
        super().__init__(module, **kwargs)
        self.experts = experts

    def _load_module(self, prefix: str, module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super()._load_module(prefix, module, self.experts.route(weights))
        return loaded | self.experts.finish()
