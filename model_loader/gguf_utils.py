"""GGUF (llama.cpp) files: find them, read their config, and stream their tensors as HF weights.

Used twice: by the engine's resolution step (`engine/arg_utils.py`, once, in the engine
process) to build the `hf_config` namespace the models expect from the GGUF metadata,
and by `GGUFModelLoader` on every rank to stream (HF name, tensor) pairs into the
model's normal `load_weights`, so TP slicing works unchanged.

Memory: `open_gguf` memory-maps the file (model_loader/gguf_reader.py). Tensors the
model holds as GGUF blocks (`hf_config.quantization_config`, decided by
model_loader/gguf_quant.py) are yielded as `<module>.qweight`, zero-copy uint8 views of
their [rows, row_bytes] bytes, and each rank's weight loader copies only its rows or
blocks: resident weights are about the file's bytes (this rank's share of them).
F32/F16/BF16 tensors are zero-copy views too; tensors of a type with no kernel become
one float32 tensor at a time. A mixture of experts' stacked expert tensors
(`ffn_gate_exps` ... [E, rows, cols]) are handed over one expert at a time under each
expert's HF name (views of the stack). Llama q/k rows are un-permuted (llama.cpp's
convert script reorders them for its interleaved RoPE): a row permutation, so it moves
whole rows of blocks, and costs one copy of that tensor.

Only tensor bytes and typed metadata are read: nothing is unpickled or executed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from model_loader.gguf_quant import gguf_quantization_config, held_type
from model_loader.gguf_reader import GGUFFile, StringArray
from models.errors import UnsupportedArchitectureError, WeightLoadError

# general.architecture -> (HF architectures entry, model_type). Mistral GGUFs say "llama".
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# Architectures whose q/k rows llama.cpp's convert_hf_to_gguf.py permutes.
_PERMUTED_QK_ARCHS = frozenset({"llama"})

# Per-layer GGUF tensor name -> HF sub-module name under model.layers.N.
_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head RMSNorms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# A mixture of experts' stacked expert tensors ([E, rows, cols]) -> the HF projection of each
# expert; `gguf_to_hf_name` names the stack `model.layers.N.mlp.experts.<proj>`.
EXPERT_STACKS: dict[str, str] = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# Arrays in the metadata longer than this (tokenizer vocab, scores, merges) are
# summarised by their length in `hf_config.gguf_metadata`, which travels to every worker.
_MAX_METADATA_ARRAY = 64


class GGUFError(ValueError):
    """A GGUF file is missing, ambiguous or lacks a key the model needs."""


def find_gguf_file(model: str | Path) -> Path:
    """`model` itself when it is a .gguf file, else the only .gguf file in directory `model`."""
    path = Path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise GGUFError(f"model={str(model)!r} is a file but not a .gguf file")
        return path
    if path.is_dir():
        files = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(files) == 1:
            return files[0]
        if not files:
            raise GGUFError(f"load_format='gguf' but the directory {path} holds no .gguf file")
        raise GGUFError(
            f"the directory {path} holds {len(files)} .gguf files ({[f.name for f in files]}); "
            "pass the path of the one to load"
        )
    raise GGUFError(f"model={str(model)!r} is neither a .gguf file nor a local directory")


def open_gguf(path: str | os.PathLike[str], mode: str = "c") -> GGUFFile:
    """The header of GGUF file `path` over a memory mapping of it (model_loader/gguf_reader.py):
    copy-on-write by default (writable views, nothing copied unless written), or
    read-only (`mode="r"`). Raises `WeightLoadError` naming the file for one that cannot
    be opened or parsed, and without the `gguf` package (its formats)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise WeightLoadError("load_format='gguf' needs the `gguf` package: pip install 'tp-runtime[gguf]'") from None
    try:
        return GGUFFile(path, mode)
    except (OSError, ValueError) as e:
        raise WeightLoadError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None


def _metadata_value(value: Any) -> Any:
    """A metadata value for `hf_config.gguf_metadata`: plain Python (it travels to every
    worker), an array longer than _MAX_METADATA_ARRAY summarised by its length."""
    if isinstance(value, (np.ndarray, StringArray, list)):
        return f"<array of {len(value)}>" if len(value) > _MAX_METADATA_ARRAY else [
            _metadata_value(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    return value


def read_gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key/value of the file, except that long arrays are replaced by '<array of N>'."""
    return {name: _metadata_value(value) for name, value in reader.metadata.items()}


def _dtype_name_for(reader: Any) -> str:
    """The natural torch dtype of the file: float32 if all F32, bfloat16 if any BF16, else float16."""
    from gguf import GGMLQuantizationType as T

    types = {t.tensor_type for t in reader.tensors}
    if types <= {T.F32}:
        return "float32"
    if T.BF16 in types:
        return "bfloat16"
    return "float16"


def gguf_hf_config(path: Path) -> SimpleNamespace:
    """The `hf_config` namespace the models expect, built from the GGUF metadata.

    Raises `UnsupportedArchitectureError` naming the file's architecture and the
    supported ones, and `GGUFError` when a required key is absent.
    """
    reader = open_gguf(path)
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported GGUF architectures: "
            f"{sorted(GGUF_ARCHITECTURES)}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}

    def get(key: str, default: Any = KeyError) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is KeyError:
            raise GGUFError(f"{path}: the GGUF metadata lacks the required key {full!r}")
        return default

    if "rope_freqs.weight" in tensors:
        raise GGUFError(
            f"{path} holds a rope_freqs tensor (llama3-style RoPE frequency scaling), which the GGUF "
            "loader does not support yet; load the original HF checkpoint instead"
        )
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    embd_rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are [ne0 = hidden, ne1 = vocab]
    vocab_size = int(get("vocab_size", embd_rows))
    head_dim = get("attention.key_length", None)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden_size,
        # (a mixture of experts' file may give only its experts' width: set below)
        "intermediate_size": int(get("feed_forward_length", 0 if model_type == "qwen3_moe" else KeyError)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": vocab_size,
        # llama.cpp ties the LM head exactly when there is no output.weight.
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "torch_dtype": _dtype_name_for(reader),
        "gguf_file": str(path),
        "gguf_metadata": meta,
    }
    if head_dim is not None and int(head_dim) != hidden_size // num_heads:
        config["head_dim"] = int(head_dim)
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        orig = get("rope.scaling.original_context_length", None)
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        config["rope_scaling"] = scaling
    for key, hf_key in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                        ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in meta:
            config[hf_key] = int(meta[key])
    if model_type == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    if model_type == "qwen3_moe":  # llama.cpp's qwen3moe: every layer sparse, top-k renormalised
        experts = int(get("expert_feed_forward_length"))
        config.update(num_experts=int(get("expert_count")), num_experts_per_tok=int(get("expert_used_count")),
                      moe_intermediate_size=experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      intermediate_size=config["intermediate_size"] or experts)
    quantization_config = gguf_quantization_config(reader, gguf_to_hf_name)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return SimpleNamespace(**config)


def gguf_to_hf_name(name: str) -> str:
    """HF checkpoint name for a GGUF tensor name; unknown names come back unchanged, so
    the model's loader reports them as unexpected weights."""
    m = _LAYER_RE.match(name)
    if m is not None:
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        if part in EXPERT_STACKS:
            return f"model.layers.{layer}.mlp.experts.{EXPERT_STACKS[part]}.{kind}"
        return name
    m = _GLOBAL_RE.match(name)
    if m is not None and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return name


def permute_qk(weights: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (HF rotate-half -> interleaved rows)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute_qk(weights: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """The inverse of `permute_qk`: GGUF rows back to the HF order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# --------------------------------------------------------------------------- dequantisation


def dequantize_q8_0(data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q8_0 blocks of 32: float16 scale d, then 32 int8 q; value = d * q."""
    blocks = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, 34))
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (d * q).reshape(shape)


def dequantize_q4_0(data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Q4_0 blocks of 32: float16 scale d, then 16 bytes; low nibbles are elements 0-15,
    high nibbles 16-31; value = d * (nibble - 8)."""
    blocks = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, 18))
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    qs = blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.float32) - 8.0
    return (d * q).reshape(shape)


def tensor_to_torch(tensor: Any) -> torch.Tensor:
    """A GGUFReader tensor as a torch tensor in HF (row-major [out, in]) shape: a zero-copy
    view for F32/F16/BF16 and the integer types, a new float32 tensor for quantised types."""
    from gguf import GGMLQuantizationType as T

    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data
    if qtype in (T.F32, T.F16, T.F64, T.I8, T.I16, T.I32, T.I64):
        return torch.from_numpy(data).reshape(shape)
    if qtype == T.BF16:
        return torch.from_numpy(data).view(torch.bfloat16).reshape(shape)
    try:
        from gguf.quants import dequantize
    except ImportError:  # an old gguf package: the two formats we promise, by hand
        dequantize = None
    if dequantize is None:
        if qtype == T.Q8_0:
            return dequantize_q8_0(data, shape)
        if qtype == T.Q4_0:
            return dequantize_q4_0(data, shape)
        raise WeightLoadError(f"GGUF tensor {tensor.name!r} has type {qtype.name}, which cannot be dequantised here")
    try:
        return torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype))).reshape(shape)
    except NotImplementedError:
        raise WeightLoadError(
            f"GGUF tensor {tensor.name!r} has type {qtype.name}, which the gguf package cannot dequantise"
        ) from None


def _held_blocks(tensor: Any) -> torch.Tensor:
    """A tensor's bytes as [rows, row_bytes] uint8: a zero-copy view of the mapping."""
    data = torch.from_numpy(tensor.data)
    rows = int(np.prod(tensor.shape.tolist()[1:]))
    return data.reshape(rows, -1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(rows, -1)


_STACK_SUFFIXES = tuple(f".experts.{proj}" for proj in EXPERT_STACKS.values())


def _expert_tensors(tensor: Any, stack: str, held: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor ([E, rows, cols]) as each expert's HF tensor:
    `...experts.<e>.<proj>.qweight`, the expert's [rows, row_bytes] block bytes (a view of
    the mapping), where the layer holds the experts as blocks, else its float values."""
    parent, proj = stack.rsplit(".", 1)
    experts = int(tensor.shape.tolist()[-1])
    if held:
        blocks = _held_blocks(tensor)  # [E * rows, row_bytes]
        weights = blocks.reshape(experts, -1, blocks.shape[-1])
    else:
        weights = tensor_to_torch(tensor)
    for e in range(experts):
        yield f"{parent}.{e}.{proj}.{'qweight' if held else 'weight'}", weights[e]


def gguf_weights_iterator(reader: GGUFFile, hf_config: SimpleNamespace) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file `reader` maps (`open_gguf`), in file
    order, q/k un-permuted for llama (a row permutation: for tensors held as blocks it
    moves whole rows of blocks).

    A module that `hf_config.quantization_config` holds as blocks (model_loader/gguf_quant.py)
    gets its tensor as `<module>.qweight`: the file's [rows, row_bytes] bytes, a view of
    the mapping (the layer's weight loader copies this rank's rows or blocks, or keeps
    the view of a table a rank takes whole: `GGUFModelLoader.load_weights`), or, for a
    type with no kernel, its dequantised float32 values."""
    held = (getattr(hf_config, "quantization_config", None) or {}).get("tensor_types", {})
    arch = getattr(hf_config, "gguf_metadata", {}).get("general.architecture")
    if arch is None:
        arch = next((k for k, (a, _) in GGUF_ARCHITECTURES.items() if a in hf_config.architectures), None)
    permuted = arch in _PERMUTED_QK_ARCHS
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        module = name.removesuffix(".weight")
        if module.endswith(_STACK_SUFFIXES):
            yield from _expert_tensors(tensor, module, module in held)
            continue
        if module in held and held_type(tensor.tensor_type.name) == tensor.tensor_type.name:
            weight, name = _held_blocks(tensor), f"{module}.qweight"
        else:
            weight = tensor_to_torch(tensor)
            name = f"{module}.qweight" if module in held else name
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.qweight", "self_attn.q_proj.bias")):
            weight = unpermute_qk(weight, n_head, n_head)
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.qweight",
                                         "self_attn.k_proj.bias")):
            weight = unpermute_qk(weight, n_head, n_kv)
        yield name, weight
