"""Loading a pre-quantised checkpoint on one rank: its logits and its resident bytes.

Used in-process at TP 1 (`load_case`) and, through `tests.conftest.run_tp`, in spawned
TP 2 processes (`tp_quant_cases`, which spawn finds by qualified name, so it lives in
this importable module).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.quant_checkpoints import module_resident_bytes


def load_case(case: dict[str, Any], tp_size: int = 1) -> dict[str, Any]:
    """Load `case["model"]` (EngineConfig keywords in `case.get("kwargs")`) and return
    this rank's logits for `case["input_ids"]`, the bytes its linear layers hold and the
    quantisation method of each, its FusedMoE layers' tensors and their bytes; with
    `case["expect_error"]`, the (type, message) of the error the load raised instead
    (None if it loaded)."""
    from engine.arg_utils import create_engine_config
    from model_loader import get_model
    from models.layers.fused_moe import FusedMoE
    from models.layers.linear import LinearBase
    from tests.tp_helpers import compute_logits_on_rank

    kwargs = {"dtype": "float32", **case.get("kwargs", {})}
    config = create_engine_config(model=case["model"], device="cpu", tensor_parallel_size=tp_size,
                                  use_tqdm_on_load=False, **kwargs)
    if case.get("expect_error"):
        try:
            get_model(config)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return {"error": (type(e).__name__, str(e))}
        return {"error": None}
    model = get_model(config)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    return {
        "logits": compute_logits_on_rank(model, case["input_ids"]),
        "linear_bytes": sum(module_resident_bytes(m) for m in linears.values()),
        "methods": {name: type(m.quant_method).__name__ for name, m in linears.items()},
        # the weight's dtype (uint8 for GGUF blocks and int4/int8 codes)
        "dtypes": {name: str(_weight_of(m).dtype) for name, m in linears.items()},
        # mixture-of-experts layers: every tensor each holds (parameters and buffers but the
        # expert-parallel map), by name (dtype, shape), and their bytes
        "experts": {name: {p: (str(t.dtype), tuple(t.shape)) for p, t in [*m.named_parameters(), *m.named_buffers()]
                           if p != "expert_map"}
                    for name, m in experts.items()},
        "expert_bytes": sum(module_resident_bytes(m) for m in experts.values()),
    }


def _weight_of(linear: torch.nn.Module) -> torch.Tensor:
    """The plain or fp8 `weight`, GGUF's block bytes (`qweight`) or the int4/int8 layout's codes."""
    for weight in (linear._parameters.get("weight"), linear._parameters.get("qweight")):
        if weight is not None:
            return weight
    return linear._buffers["wna16_qweight"]


def tp_quant_cases(rank: int, world_size: int, port: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """`load_case` for each case at TP=`world_size`: {case name: result} on this rank."""
    from tests.tp_helpers import init_tp, shutdown_tp

    init_tp(rank, world_size, port)
    try:
        return {case["name"]: load_case(case, world_size) for case in cases}
    finally:
        shutdown_tp()


def hf_logits(hf_model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits [T, vocab] for one sequence."""
    with torch.no_grad():
        return hf_model(input_ids.view(1, -1)).logits[0].float()
