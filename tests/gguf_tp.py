"""The rank function of the GGUF tensor-parallel tests (spawn pickles it by name, so it
lives in an importable module; see tests/tp_helpers.py)."""

from __future__ import annotations

from typing import Any

import torch

from tests.tp_helpers import compute_logits_on_rank, init_tp, shutdown_tp

# Buffers that hold no weight: the rotary tables, computed from config.json.
_DERIVED_BUFFERS = ("cos_cached", "sin_cached")


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (each storage counted once),
    except the rotary tables."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if not n.endswith(_DERIVED_BUFFERS))]
    for t in tensors:
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except RuntimeError:  # a tensor subclass without a plain storage (a CPU-packed weight)
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def gguf_tp_cases(rank: int, world_size: int, port: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Load each case's GGUF file at TP=`world_size` (in `case["dtype"]`, default
    float32): {case name: this rank's logits, heads, table rows and resident bytes}."""
    from engine.arg_utils import create_engine_config
    from model_loader import get_model

    init_tp(rank, world_size, port)
    try:
        results: dict[str, Any] = {}
        for case in cases:
            config = create_engine_config(model=case["model"], dtype=case.get("dtype", "float32"), device="cpu",
                                          load_format="gguf",
                                          tensor_parallel_size=world_size, use_tqdm_on_load=False)
            model = get_model(config)
            attn = model.model.layers[0].self_attn
            results[case["name"]] = {
                "logits": compute_logits_on_rank(model, case["input_ids"]),
                "num_heads": attn.num_heads,
                "num_kv_heads": attn.num_kv_heads,
                "embed_rows": model.model.embed_tokens.num_embeddings_per_partition,
                "resident_bytes": resident_bytes(model),
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            }
            del model
        return results
    finally:
        shutdown_tp()
