"""Pre-quantised test checkpoints, written by the test itself, and their float oracle.

A quantised checkpoint is a tiny random Llama (transformers builds it) whose linear
weights are replaced by a format's tensors (GPTQ's qweight/qzeros/scales, AWQ's,
compressed-tensors' weight_packed/weight_scale, int8/fp8 weights and scales, ...):

    config = tiny_llama_config()                         # hidden 256, 2 layers, vocab 320
    state = random_llama_state_dict(config, seed=1)      # float32, transformers' names
    ckpt = write_quantized_checkpoint(out_dir, config, state, quantize, {"quant_method": ...})
    hf = hf_model_from_state_dict(config, ckpt.dequantized)   # the oracle

`quantize(module_name, weight [out, in] float32)` returns (tensors, dequantised) — the
checkpoint tensors under their suffixes ({"qweight": ..., "scales": ...}, stored as
`<module_name>.<suffix>`) and the float32 weight they stand for — or None to keep that
module's float `weight` (an ignored layer). The oracle is transformers run on the
dequantised weights, so a correct kernel matches it to float32 rounding whatever the
quantiser chose; the quantiser only has to follow the format's layout exactly.

`quantize_int_groups` is the plain asymmetric/symmetric grouped integer quantiser the
integer formats share (each format then packs its codes its own way).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# (tensors by suffix, dequantised float32 weight), or None: keep the float weight.
Quantizer = Callable[[str, torch.Tensor], "tuple[dict[str, torch.Tensor], torch.Tensor] | None"]


def tiny_llama_config(**overrides: Any) -> Any:
    """transformers' LlamaConfig for a tiny model: hidden 256 (a group of 128 divides it
    and its TP 2 halves), intermediate 512, 2 layers, 4 heads of 64 / 2 KV heads, vocab
    320, untied embeddings, eos disabled (generation never stops early)."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 320,
                          "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None}
    return LlamaConfig(**{**kw, **overrides})


def random_llama_state_dict(config: Any, seed: int, init_std: float = 0.05) -> dict[str, torch.Tensor]:
    """transformers' float32 state dict for `config`, weights N(0, init_std), norm weights
    1 + 0.1 N(0, 1) (tests/hf_checkpoints.py's recipe). A tied LM head is left out, as
    save_pretrained leaves it out."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, init_std)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def linear_module_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The checkpoint module names of the linear layers ("model.layers.0.self_attn.q_proj")."""
    return [k[: -len(".weight")] for k in state if k.endswith(".weight") and k.split(".")[-2] in LINEAR_MODULES]


@dataclass
class QuantizedCheckpoint:
    path: Path
    dequantized: dict[str, torch.Tensor]  # the float32 state dict the checkpoint stands for
    quantized_bytes: int  # bytes of the linear layers' tensors as written (quantised or not)
    other_bytes: int  # everything else: embeddings, norms, LM head


def write_quantized_checkpoint(out_dir: Path, config: Any, state: dict[str, torch.Tensor], quantize: Quantizer,
                               quantization_config: dict[str, Any] | None, *,
                               quant_config_file: str | None = None,
                               dtype: torch.dtype = torch.float32) -> QuantizedCheckpoint:
    """Write config.json + model.safetensors with every linear module's weight replaced by
    `quantize`'s tensors. The other tensors are written in `dtype` (and the dequantised
    state dict holds them as written, upcast to float32). `quantization_config` goes into
    config.json, or, with `quant_config_file` ("quantize_config.json", "quant_config.json"),
    into that file beside it (without `quant_method`, as AutoGPTQ and AutoAWQ write it)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    linear = set(linear_module_names(state))
    quantized_bytes = other_bytes = 0
    for key, value in state.items():
        module = key[: -len(".weight")] if key.endswith(".weight") else None
        result = quantize(module, value.float()) if module in linear else None
        if result is None:
            stored = value.to(dtype).contiguous()
            tensors[key] = stored
            dequantized[key] = stored.float()
            size = stored.numel() * stored.element_size()
            if module in linear or key.endswith(".bias") and key[: -len(".bias")] in linear:
                quantized_bytes += size
            else:
                other_bytes += size
            continue
        parts, deq = result
        assert deq.shape == value.shape, (key, deq.shape, value.shape)
        for suffix, tensor in parts.items():
            tensors[f"{module}.{suffix}"] = tensor.contiguous()
            quantized_bytes += tensor.numel() * tensor.element_size()
        dequantized[key] = deq.float()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        if quant_config_file is None:
            cfg["quantization_config"] = quantization_config
        else:
            body = {k: v for k, v in quantization_config.items() if k != "quant_method"}
            (out_dir / quant_config_file).write_text(json.dumps(body, indent=2))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return QuantizedCheckpoint(out_dir, dequantized, quantized_bytes, other_bytes)


def hf_model_from_state_dict(config: Any, state: dict[str, torch.Tensor]) -> Any:
    """transformers' float32 model holding `state` (the dequantised weights): the oracle.
    eos is disabled so that generate() never stops early."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" and config.tie_word_embeddings for k in missing), missing
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of every registered parameter and buffer (what state_dict() and the memory
    accounting see), each tensor once."""
    seen: dict[int, torch.Tensor] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen.setdefault(id(t), t)
    return resident_bytes(seen.values())


def quantize_int_groups(weight: torch.Tensor, bits: int, group_size: int, sym: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] int32 in [0, 2^bits), scales [out, groups] float32, zeros [out,
    groups] int32) with weight ≈ (codes - zeros) * scales, group g covering inputs
    [g*group_size, (g+1)*group_size) (group_size -1: one group per row). Symmetric: the
    zero point is 2^(bits-1) and the scale absmax / (2^(bits-1) - 1/2), so the codes use
    [0, 2^bits) around the middle. Asymmetric: min/max over the group (0 included)."""
    out_features, in_features = weight.shape
    group = in_features if group_size == -1 else group_size
    assert in_features % group == 0
    w = weight.float().reshape(out_features, in_features // group, group)
    maxq = (1 << bits) - 1
    if sym:
        scales = (w.abs().amax(-1) / (maxq / 2)).clamp(min=1e-8)
        zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((hi - lo) / maxq).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, maxq).to(torch.int32)
    codes = torch.round(w / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(0, maxq).to(torch.int32)
    return codes.reshape(out_features, in_features), scales, zeros


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned `bits`-bit values (int32 tensor) 32 // bits to an int32 along `dim`,
    value j of each pack in bits [j*bits, (j+1)*bits) (`order`: the value placed at
    position j is `order[j]` of the pack, AWQ's interleave). The int32 wraps (the top
    value's high bit is the sign bit), as the formats store it."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    assert v.shape[-1] % per == 0
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    packed = (v << shifts).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """`pack_int32`'s inverse: int32 values in [0, 2^bits)."""
    per = 32 // bits
    p = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    v = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inverse = [0] * per
        for j, src in enumerate(order):
            inverse[src] = j
        v = v[..., inverse]
    v = v.reshape(*v.shape[:-2], v.shape[-2] * per)
    return v.movedim(-1, dim).to(torch.int32).contiguous()


def quantized_linear_report(model: torch.nn.Module) -> dict[str, Any]:
    """What a quantised model holds in its linear layers (models.layers.linear.LinearBase):
    their resident bytes, the whole model's, and the names of the layers' parameters and
    buffers (one layer's, for layout checks)."""
    from models.layers.linear import LinearBase

    linears = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
    first = next(iter(linears.values()))
    return {
        "linear_bytes": sum(module_resident_bytes(m) for m in linears.values()),
        "model_bytes": module_resident_bytes(model),
        "tensor_names": sorted({n for m in linears.values() for n, _ in [*m.named_parameters(), *m.named_buffers()]}),
        "first_linear_tensors": sorted(n for n, _ in [*first.named_parameters(), *first.named_buffers()]),
    }


def tp_load_quantized(rank: int, world_size: int, port: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """For tests.conftest.run_tp: load each case's checkpoint at TP=`world_size` (float32,
    CPU) and return {name: {"logits": [T, vocab], **quantized_linear_report}}, or, for a
    case with "expect_error", (error type name, message) / None."""
    from engine.arg_utils import create_engine_config
    from model_loader import get_model
    from tests.tp_helpers import compute_logits_on_rank, init_tp, shutdown_tp

    init_tp(rank, world_size, port)
    try:
        results: dict[str, Any] = {}
        for case in cases:
            config = create_engine_config(model=case["model"], dtype="float32", device="cpu",
                                          tensor_parallel_size=world_size, use_tqdm_on_load=False,
                                          **case.get("kwargs", {}))
            if case.get("expect_error"):
                try:
                    get_model(config)
                except Exception as e:  # noqa: BLE001 - reported to the test
                    results[case["name"]] = (type(e).__name__, str(e))
                else:
                    results[case["name"]] = None
                continue
            model = get_model(config)
            results[case["name"]] = {"logits": compute_logits_on_rank(model, case["input_ids"]),
                                     **quantized_linear_report(model)}
            del model
        return results
    finally:
        shutdown_tp()


class Oracles:
    """transformers models on the dequantised weights of a module's checkpoints, built on
    first use: `oracles(name)`."""

    def __init__(self, config: Any, checkpoints: dict[str, QuantizedCheckpoint]) -> None:
        self.config, self.checkpoints = config, checkpoints
        self.models: dict[str, Any] = {}

    def __call__(self, name: str) -> Any:
        if name not in self.models:
            self.models[name] = hf_model_from_state_dict(self.config, self.checkpoints[name].dequantized)
        return self.models[name]


def hf_logits(hf: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits [T, vocab] for one sequence."""
    with torch.no_grad():
        return hf(input_ids.unsqueeze(0)).logits[0].float()


def assert_engine_greedy_matches(model_dir: Path, hf: Any, prompts: list[list[int]], max_new: int,
                                 tensor_parallel_size: int = 1) -> None:
    """The engine's greedy tokens (float32, CPU) equal transformers' for every prompt."""
    from config import SamplingParams
    from engine.core import EngineCore
    from tests.test_generation import hf_greedy

    with EngineCore(model=str(model_dir), device="cpu", dtype="float32", max_model_len=64,
                    tensor_parallel_size=tensor_parallel_size, kv_cache_memory_bytes=4 << 20,
                    use_tqdm_on_load=False) as core:
        outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, max_new)[0], (str(model_dir), len(prompt))
