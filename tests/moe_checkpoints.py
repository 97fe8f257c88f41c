"""Tiny mixture-of-experts checkpoints written by transformers itself, for tests/test_moe.py.

`write_moe_checkpoint(out_dir, family, **overrides)` builds a random
`MixtralForCausalLM` or `Qwen3MoeForCausalLM` (hidden 64, 2 layers, 4 heads / 2 kv
heads, vocab 320, 4 experts, top 2, experts 32 wide, float32) and saves it with
tests/hf_checkpoints.py's `save_random_checkpoint` (std 0.1 weights, so attention and
routing are far from uniform; safetensors with per-expert tensor names, as
transformers 5 writes them).
`expert_tensor_names(dir)` lists the per-expert tensors in the written files.
`naive_moe_reference(...)` is the per-token loop the kernels are checked against.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tests.hf_checkpoints import save_random_checkpoint

FAMILIES = ("mixtral", "qwen3_moe")
_COMMON: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, vocab_size=320, max_position_embeddings=256,
                               num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_moe_checkpoint(out_dir: Path, family: str, seed: int = 0, num_experts: int = 4,
                         **overrides: Any) -> Path:
    import transformers

    if family == "mixtral":
        kwargs = dict(_COMMON, intermediate_size=32, num_local_experts=num_experts)
        cfg_cls = transformers.MixtralConfig
    elif family == "qwen3_moe":
        kwargs = dict(_COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=num_experts,
                      norm_topk_prob=True)
        cfg_cls = transformers.Qwen3MoeConfig
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    kwargs.update(overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    return save_random_checkpoint(cfg_cls(**kwargs), out_dir, seed)


def expert_tensor_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names += [n for n in f.keys() if re.search(r"\.experts\.\d+\.", n)]
    return sorted(names)


def expert_shapes_on_rank(worker: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """For `EngineCore.collective_rpc`: (w13 shape, w2 shape) of every FusedMoE on this rank."""
    from models.layers.fused_moe import FusedMoE

    model = worker.model_runner.model
    return [(tuple(m.w13_weight.shape), tuple(m.w2_weight.shape)) for m in model.modules() if isinstance(m, FusedMoE)]


def edit_config(model_dir: Path, **fields: Any) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def naive_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, local_of_global: dict[int, int] | None = None) -> torch.Tensor:
    """One token, one routed expert at a time, in float64: the specification."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            expert = int(topk_ids[t, j])
            local = expert if local_of_global is None else local_of_global.get(expert)
            if local is None:
                continue
            x = hidden[t].double()
            gate_up = w13[local].double() @ x
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[local].double() @ act)
    return out


# ------------------------------------------------------------------ the quantised experts' one-call kernels


def experts_layer(model_path: Path, dtype: str, layer: int = 0) -> torch.nn.Module:
    """Layer `layer`'s FusedMoE of a checkpoint or GGUF file, loaded on the CPU in `dtype`."""
    from engine.arg_utils import create_engine_config
    from model_loader import get_model

    model = get_model(create_engine_config(model=str(model_path), device="cpu", dtype=dtype, use_tqdm_on_load=False))
    return model.model.layers[layer].mlp.experts


def grouped_apply(module: Any, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  monkeypatch: Any) -> torch.Tensor:
    """`layer`'s quantised experts grouped in torch: the one-call C kernel of the method's
    module (`module.MAX_KERNEL_TOKENS`) switched off, for comparison."""
    with monkeypatch.context() as patch:
        patch.setattr(module, "MAX_KERNEL_TOKENS", 0)
        return layer.quant_method.apply(layer, x, topk_weights, topk_ids)


def captured_sizes(worker: Any) -> list[int]:
    """For `EngineCore.collective_rpc`: the decode batch sizes this rank recorded as CPU graphs."""
    graphs = worker.model_runner.cpu_graphs
    return [] if graphs is None else graphs.captured_sizes


def decode_with_graphs(model_path: Path, eager: bool) -> tuple[list, list]:
    """Three bfloat16 requests' greedy tokens and logprobs, eager or with CPU graphs, and
    the batch sizes recorded (one rank)."""
    from config import SamplingParams
    from engine.core import EngineCore

    prompts = [[5, 9, 13, 2, 7, 11, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42, 17]]
    with EngineCore(model=str(model_path), device="cpu", dtype="bfloat16", max_model_len=128,
                    kv_cache_memory_bytes=1 << 22, block_size=16, enforce_eager=eager,
                    use_tqdm_on_load=False) as core:
        outs = core.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
                                       for n in (12, 6, 9)])
        sizes = core.collective_rpc(captured_sizes)
    return [(o.token_ids, o.logprobs) for o in outs], sizes
