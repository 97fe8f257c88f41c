"""Which GGUF tensors stay in their block formats, decided once from the file's header.

`gguf_quantization_config(reader)` runs in the resolution step (through
`gguf_utils.gguf_hf_config`) and gives the `quantization_config` every rank's
`GGUFConfig` is built from (`models/layers/quantization/gguf.py` documents its form),
or None for a file with no tensor we hold quantised (F16/BF16/F32 files: the plain
path, as before). The rules:

- a linear tensor of a type with a kernel (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K) is held as
  blocks, and so is every tensor its layer fuses with it (q/k/v; gate/up), each in its
  own type: F16/BF16/F32 as they are, a type with no kernel dequantised to "F32";
- token_embd and output are held as blocks when their type has a kernel;
- a mixture of experts' stacked experts (ffn_gate_exps, ffn_up_exps, ffn_down_exps) are
  held as blocks when all three of a layer's have kernel types (gate and up alike:
  otherwise a ValueError), else dequantised (models/layers/quantization/gguf_moe.py);
- everything else (norms, biases, layers with only float or kernel-less types) is
  plain, a kernel-less type dequantised at load as before, and logged once by type.

`check_gguf_tensor_parallel(hf_config, tp_size)` refuses, before any worker starts, a TP
size at which a row-parallel layer's per-rank input is not whole blocks (its blocks
would be split between ranks).
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace
from typing import Any

from models.layers.quantization.gguf_dequant import (
    FLOAT_TYPES,
    GGUF_FORMATS,
    QUANTIZED_TYPES,
)

logger = logging.getLogger(__name__)

_LINEAR_RE = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
# GGUF tensors our layers fuse into one (QKVParallelLinear, MergedColumnParallelLinear).
_FUSED_GROUPS = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv",
                 "ffn_gate": "ffn_gate_up", "ffn_up": "ffn_gate_up"}
_EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight$")
# The row-parallel modules, and the hf_config size that is their input.
_ROW_PARALLEL = {"self_attn.o_proj": "attention", "mlp.down_proj": "intermediate_size"}


def held_type(file_type: str) -> str:
    """The type a tensor of `file_type` is held in inside a block-holding layer."""
    return file_type if file_type in GGUF_FORMATS else "F32"


def gguf_quantization_config(reader: Any, hf_name: Any) -> dict[str, Any] | None:
    """{"quant_method": "gguf", "tensor_types": {HF module: held type}} for the tensors
    held as blocks (see the module docstring), or None when there are none. `hf_name`
    maps a GGUF tensor name to its HF name (gguf_utils.gguf_to_hf_name)."""
    file_types = {t.name: t.tensor_type.name for t in reader.tensors}
    groups: dict[tuple[str, str], list[str]] = {}
    for name in file_types:
        m = _LINEAR_RE.match(name)
        if m is not None:
            layer, part = m.groups()
            groups.setdefault((layer, _FUSED_GROUPS.get(part, part)), []).append(name)
    tensor_types: dict[str, str] = {}
    # A mixture of experts' stacks: held as blocks when all three of a layer's have kernels.
    stacks: dict[str, dict[str, str]] = {}
    for name in file_types:
        if (m := _EXPERTS_RE.match(name)) is not None:
            stacks.setdefault(m.group(1), {})[m.group(2)] = name
    for layer, parts in stacks.items():
        if sorted(parts) == sorted(_EXPERT_PARTS) and all(file_types[n] in QUANTIZED_TYPES for n in parts.values()):
            if file_types[parts["ffn_gate_exps"]] != file_types[parts["ffn_up_exps"]]:
                raise ValueError(f"GGUF layer {layer}: its experts' gate ({file_types[parts['ffn_gate_exps']]}) and "
                                 f"up ({file_types[parts['ffn_up_exps']]}) stacks differ in type, which the "
                                 "experts' kernels do not serve")
            for n in parts.values():
                tensor_types[hf_name(n).removesuffix(".weight")] = file_types[n]
    for members in groups.values():
        if any(file_types[n] in QUANTIZED_TYPES for n in members):
            for n in members:
                tensor_types[hf_name(n).removesuffix(".weight")] = held_type(file_types[n])
    for name in ("token_embd.weight", "output.weight"):
        if file_types.get(name) in QUANTIZED_TYPES:
            tensor_types[hf_name(name).removesuffix(".weight")] = file_types[name]
    dequantised = sorted({t for n, t in file_types.items() if t not in GGUF_FORMATS})
    if dequantised:
        logger.warning("GGUF types with no kernel here are dequantised at load: %s (held as float; kernels: %s)",
                       dequantised, list(QUANTIZED_TYPES))
    return {"quant_method": "gguf", "tensor_types": tensor_types} if tensor_types else None


def check_gguf_tensor_parallel(hf_config: SimpleNamespace, tp_size: int) -> None:
    """Raise ValueError naming tensor_parallel_size, the module and its type when a
    row-parallel layer's per-rank input is not a whole number of its blocks."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant or quant.get("quant_method") != "gguf" or tp_size == 1:
        return
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    inputs = {"attention": hf_config.num_attention_heads * head_dim,
              "intermediate_size": hf_config.intermediate_size}
    for module, qtype in quant["tensor_types"].items():
        suffix = next((s for s in _ROW_PARALLEL if module.endswith(s)), None)
        if suffix is None or qtype in FLOAT_TYPES:
            continue
        per_rank, block = inputs[_ROW_PARALLEL[suffix]] // tp_size, GGUF_FORMATS[qtype].block_size
        if per_rank % block:
            raise ValueError(f"tensor_parallel_size={tp_size} splits {module} ({qtype}, blocks of {block} values) "
                             f"into {per_rank} inputs per rank, not whole blocks; use a tensor_parallel_size that "
                             f"leaves a multiple of {block}")
