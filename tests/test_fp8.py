"""quantization="fp8": online per-output-channel fp8 (e4m3) weights for the linear layers.

What is checked, on the tiny random checkpoints (hidden 64, 2 layers, init_std 0.1):
- every parallel linear layer holds a float8_e4m3fn weight and float32 [out, 1] scales;
  embeddings, norms and the LM head keep the model dtype;
- weight bytes of the linear layers fall to ≈0.53x of bf16 (1 byte per element plus
  4 bytes of scale per output row, rows of 64-128 inputs); the whole model's
  parameter + buffer bytes fall too (less, since embeddings, LM head and the RoPE
  tables stay as they are);
- each quantised element is within fp8 rounding of the original (relative 2^-4, or
  2^-9 of the row's scale near zero);
- the forward is exactly "dequantise, then F.linear": logits equal an unquantised
  model holding the dequantised weights to 1e-5;
- against the unquantised float32 model: logits' relative L2 error < 15% (observed ≈7%,
  per-weight error ≈2.6% amplified by the random model). Greedy decoding of 8 prompts x
  16 tokens: with the same context the fp8 model picks the reference's token ≥ 80% of
  the time (observed 88%; this random model's top-2 logit gaps are often smaller than
  the fp8 perturbation) and one of its top 3 ≥ 95% (observed 100%); decoding freely,
  ≥ 40% of tokens agree (observed 62%; bf16-vs-fp32 unquantised gives 82%/100% here);
- TP=2 works: rank-local scales of column (rows) and row-parallel (their own input
  slice) shards give logits within the same tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from config import ConfigError
from engine.arg_utils import create_engine_config
from model_loader import get_model
from models.layers.linear import LinearBase
from models.layers.quantization import get_quantization_config
from models.layers.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod, dequantize_fp8, quantize_fp8_per_channel
from models.layers.unquantized import UnquantizedLinearMethod, prepack_cpu_weights
from tests.conftest import run_tp
from tests.tp_helpers import compute_logits_on_rank, tp_load_cases

LOGITS_REL_TOL = 0.15
NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 8, 16


def load(model_dir: Path | str, **kwargs: Any) -> torch.nn.Module:
    kwargs.setdefault("dtype", "float32")
    return get_model(create_engine_config(model=str(model_dir), device="cpu", use_tqdm_on_load=False, **kwargs))


def linears(model: torch.nn.Module) -> dict[str, LinearBase]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: torch.nn.Module) -> int:
    return nbytes(module.parameters()) + nbytes(module.buffers())


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    ids = prompt.clone()
    for _ in range(steps):
        logits = model.compute_logits(model(ids, torch.arange(ids.numel())))
        ids = torch.cat([ids, logits[-1].argmax().view(1)])
    return ids[prompt.numel():].tolist()


@torch.no_grad()
def next_token_choices(model: torch.nn.Module, seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The model's argmax after each prefix of `seq` from the prompt on (teacher forcing)."""
    logits = model.compute_logits(model(seq, torch.arange(seq.numel())))
    return logits[prompt_len - 1 : -1].argmax(-1)


@torch.no_grad()
def top_k_choices(model: torch.nn.Module, seq: torch.Tensor, prompt_len: int, k: int) -> torch.Tensor:
    logits = model.compute_logits(model(seq, torch.arange(seq.numel())))
    return logits[prompt_len - 1 : -1].topk(k, dim=-1).indices


# ------------------------------------------------------------------ unit level


def test_quantize_per_channel_roundtrip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen) * torch.logspace(-3, 1, 96).unsqueeze(1)
    w[5] = 0.0  # an all-zero row stays zero
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (96, 1)
    deq = dequantize_fp8(q, scale, torch.float32)
    assert torch.all(deq[5] == 0)
    # Each row's largest magnitude maps to the fp8 maximum, 448.
    torch.testing.assert_close(q.float().abs().amax(1)[w.abs().amax(1) > 0], torch.full((95,), 448.0))
    bound = w.abs() * 2.0**-4 + scale * 2.0**-9
    assert torch.all((deq - w).abs() <= bound)


def test_unquantised_layers_use_plain_linear(tiny_models):
    model = load(tiny_models["llama"])
    assert all(isinstance(m.quant_method, UnquantizedLinearMethod) for m in linears(model).values())
    assert all(m.weight.dtype == torch.float32 for m in linears(model).values())


def test_unknown_quantization_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="quantization"):
        create_engine_config(model=str(tiny_models["llama"]), quantization="int3", device="cpu")
    with pytest.raises(ValueError, match="supported methods"):
        get_quantization_config("int3")


# ------------------------------------------------------------------ model level


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fp8_weights_memory_and_exact_dequant_forward(name, tiny_models):
    ref = load(tiny_models[name])
    fp8 = load(tiny_models[name], quantization="fp8")
    ref_linears, fp8_linears = linears(ref), linears(fp8)
    assert set(ref_linears) == set(fp8_linears) and len(fp8_linears) == 4 * 2  # qkv, o, gate_up, down x 2 layers
    for lname, layer in fp8_linears.items():
        assert isinstance(layer.quant_method, Fp8LinearMethod), lname
        assert layer.weight.dtype == FP8_DTYPE, lname
        assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (layer.weight.shape[0], 1)
        w = ref_linears[lname].weight
        deq = dequantize_fp8(layer.weight, layer.weight_scale, torch.float32)
        assert torch.all((deq - w).abs() <= w.abs() * 2.0**-4 + layer.weight_scale * 2.0**-9), lname
        if layer.bias is not None:
            assert layer.bias.dtype == torch.float32
    # Embeddings, norms and the LM head are not quantised.
    assert fp8.model.embed_tokens.weight.dtype == torch.float32
    assert fp8.lm_head.weight.dtype == torch.float32
    assert fp8.model.norm.weight.dtype == torch.float32

    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(7))
    fp8_logits = compute_logits_on_rank(fp8, ids)
    ref_logits = compute_logits_on_rank(ref, ids)
    # The forward is exactly dequantise + F.linear: the reference model holding the
    # dequantised weights gives the same logits.
    for lname, layer in fp8_linears.items():
        ref_linears[lname].weight.data.copy_(dequantize_fp8(layer.weight, layer.weight_scale, torch.float32))
    prepack_cpu_weights(ref)  # weights changed after loading: refresh the packed copies
    torch.testing.assert_close(fp8_logits, compute_logits_on_rank(ref, ids), atol=1e-5, rtol=1e-5)
    assert rel_err(fp8_logits, ref_logits) < LOGITS_REL_TOL


def test_fp8_memory_against_bf16(tiny_models, record_property):
    bf16 = load(tiny_models["llama"], dtype="bfloat16")
    fp8 = load(tiny_models["llama"], dtype="bfloat16", quantization="fp8")
    lin_bf16 = sum(module_bytes(m) for m in linears(bf16).values())
    lin_fp8 = sum(module_bytes(m) for m in linears(fp8).values())
    total_bf16, total_fp8 = module_bytes(bf16), module_bytes(fp8)
    record_property("linear_bytes_ratio", lin_fp8 / lin_bf16)
    record_property("model_bytes_ratio", total_fp8 / total_bf16)
    print(f"\nfp8 vs bf16 bytes: linear layers {lin_fp8}/{lin_bf16} = {lin_fp8 / lin_bf16:.3f}; "
          f"whole model (params + buffers) {total_fp8}/{total_bf16} = {total_fp8 / total_bf16:.3f}")
    assert lin_fp8 / lin_bf16 < 0.55  # ≈ 0.5 plus 4 bytes of scale per output row
    # The whole model falls by exactly what the linear layers saved: nothing else was touched.
    assert total_bf16 - total_fp8 == lin_bf16 - lin_fp8
    # bf16 logits stay close to unquantised bf16.
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(3))
    assert rel_err(compute_logits_on_rank(fp8, ids), compute_logits_on_rank(bf16, ids)) < LOGITS_REL_TOL


@pytest.mark.slow
def test_fp8_greedy_agreement(tiny_models, record_property):
    ref = load(tiny_models["llama"])
    fp8 = load(tiny_models["llama"], quantization="fp8")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 320, (PROMPT_LEN,), generator=gen) for _ in range(NUM_PROMPTS)]
    free_same = forced_same = in_top3 = total = 0
    for prompt in prompts:
        ref_out = greedy(ref, prompt, NEW_TOKENS)
        fp8_out = greedy(fp8, prompt, NEW_TOKENS)
        free_same += sum(a == b for a, b in zip(ref_out, fp8_out))
        seq = torch.cat([prompt, torch.tensor(ref_out)])
        choices = next_token_choices(fp8, seq, PROMPT_LEN)
        forced_same += int((choices == torch.tensor(ref_out)).sum())
        ref_top3 = top_k_choices(ref, seq, PROMPT_LEN, 3)
        in_top3 += int((ref_top3 == choices.unsqueeze(1)).any(1).sum())
        total += NEW_TOKENS
    free, forced, top3 = free_same / total, forced_same / total, in_top3 / total
    record_property("greedy_free_running_agreement", free)
    record_property("greedy_same_context_agreement", forced)
    record_property("greedy_same_context_in_ref_top3", top3)
    print(f"\nfp8 vs unquantised greedy, {NUM_PROMPTS} prompts x {NEW_TOKENS} tokens: free-running {free:.3f}, "
          f"same-context {forced:.3f}, fp8 pick in reference top-3 {top3:.3f}")
    # The random model's logits are nearly flat (top-2 gaps often < the ~0.2 fp8 perturbation),
    # so exact agreement is modest; the fp8 pick is nevertheless (almost) always a top-3 one.
    assert forced >= 0.8
    assert top3 >= 0.95
    assert free >= 0.4


@pytest.mark.slow
def test_fp8_tp2(tiny_models, hf_logits):
    """TP=2 in real gloo processes: column shards keep their rows' scales, row-parallel
    shards quantise their own input slice; logits stay within the fp8 tolerance."""
    cases = []
    for name in ("llama", "qwen2"):
        ids, _ = hf_logits(name)
        cases.append({"name": name, "model": str(tiny_models[name]), "input_ids": ids,
                      "kwargs": {"quantization": "fp8"}})
    results = run_tp(tp_load_cases, 2, cases)
    for case in cases:
        _, expected = hf_logits(case["name"])
        tp1 = compute_logits_on_rank(load(case["model"], quantization="fp8"), case["input_ids"])
        for res in results:
            got = res[case["name"]]
            assert got["num_heads"] == 2
            err = rel_err(got["logits"], expected)
            assert 1e-4 < err < LOGITS_REL_TOL, (case["name"], err)  # quantised, and close
            assert rel_err(got["logits"], tp1) < LOGITS_REL_TOL
        torch.testing.assert_close(results[0][case["name"]]["logits"], results[1][case["name"]]["logits"])


def test_save_sharded_state_refuses_a_quantized_model(tiny_models, tmp_path):
    from engine.core import EngineCore
    from executor.errors import RemoteWorkerError

    with EngineCore(model=str(tiny_models["llama"]), device="cpu", dtype="float32", quantization="fp8",
                    kv_cache_memory_bytes=1 << 20, max_model_len=64, use_tqdm_on_load=False) as core:
        # In-process at TP=1 the worker's error reaches us as is; through processes, wrapped.
        with pytest.raises((ValueError, RemoteWorkerError), match="quantization='fp8'"):
            core.save_sharded_state(str(tmp_path / "out"))
    assert not list((tmp_path / "out").glob("model-rank-*.safetensors"))
