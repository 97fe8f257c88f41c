"""GPTQ and AWQ checkpoints against transformers on their dequantised weights.

Each checkpoint is a tiny random Llama (hidden 256, intermediate 512, 2 layers, 4 heads
/ 2 KV heads) whose linear weights the test quantises itself (tests/wna16_formats.py,
following AutoGPTQ's and AutoAWQ's packing), written with config.json's
quantization_config or the quantiser's own quantize_config.json / quant_config.json.
The oracle is transformers' float32 model holding the dequantised weights, so a correct
kernel matches it to float32 rounding:

- logits at TP 1 and TP 2 within 1e-4 (float32 activations);
- greedy tokens equal transformers' for 8 steps through the engine (TP 1; TP 2 slow);
- resident bytes of the linear layers within 10% of the checkpoint's quantised tensors
  (per rank: its share), never a float copy; the checkpoint's tensors are gone and the
  WNA16 layout's buffers are all the layers hold;
- desc_act (g_idx) at TP 1 and on row-parallel shards at TP 2, asymmetric zero points,
  v1 and v2 zero points, int8, per-channel groups, group 128;
- refusals through create_engine_config: a ConfigError naming the field and value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from config.utils import ConfigError
from engine.arg_utils import create_engine_config
from model_loader import get_model
from tests.conftest import run_tp
from tests.quant_checkpoints import (
    Oracles,
    QuantizedCheckpoint,
    assert_engine_greedy_matches,
    hf_logits,
    quantized_linear_report,
    random_llama_state_dict,
    tiny_llama_config,
    tp_load_quantized,
    write_quantized_checkpoint,
)
from tests.test_generation import make_prompts
from tests.tp_helpers import compute_logits_on_rank
from tests.wna16_formats import awq_quantizer, gptq_quantizer

LOGITS_ATOL = 1e-4
MAX_NEW = 8
LAYOUT_BUFFERS = {"wna16_block_group", "wna16_qweight", "wna16_scales", "wna16_zeros"}


def _gptq(bits: int, group: int, sym: bool, desc_act: bool, fmt: str = "gptq") -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": fmt, "lm_head": False}


# name -> (quantizer, quantization_config, file beside config.json or None)
CASES: dict[str, tuple[Callable, dict[str, Any], str | None]] = {
    "gptq4_g128_sym": (gptq_quantizer(4, 128, True, False), _gptq(4, 128, True, False), None),
    "gptq4_g32_asym_desc_act": (gptq_quantizer(4, 32, False, True), _gptq(4, 32, False, True), None),
    "gptq8_channel_sym": (gptq_quantizer(8, -1, True, False), _gptq(8, -1, True, False), None),
    "gptq8_g64_asym_v2_file": (gptq_quantizer(8, 64, False, False, "gptq_v2"),
                               _gptq(8, 64, False, False, "gptq_v2"), "quantize_config.json"),
    "awq_g64": (awq_quantizer(64), {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                    "version": "gemm"}, None),
    "awq_g128_file": (awq_quantizer(128), {"quant_method": "awq", "w_bit": 4, "q_group_size": 128,
                                           "zero_point": True, "version": "GEMM"}, "quant_config.json"),
}
TP2_CASES = ("gptq4_g128_sym", "gptq4_g32_asym_desc_act", "awq_g64")
# Resident bytes per rank / its share of the checkpoint's quantised tensors, at most. A
# row-parallel shard of an act-order checkpoint holds all groups' scales and zeros and
# pads each group it holds to whole 32-input blocks: with groups of 32 split over 2
# ranks (about 16 inputs each) its row-parallel layers (o_proj, down_proj) nearly
# double, and they are a third of the weights here (measured 1.40; GPTQ's usual group
# of 128 over large layers pads far less).
TP2_BYTES_BOUND = {"gptq4_g32_asym_desc_act": 1.5}


@pytest.fixture(scope="module")
def llama() -> tuple[Any, dict[str, torch.Tensor]]:
    config = tiny_llama_config()
    return config, random_llama_state_dict(config, seed=37)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, llama: tuple) -> dict[str, QuantizedCheckpoint]:
    config, state = llama
    root = tmp_path_factory.mktemp("gptq_awq")
    return {name: write_quantized_checkpoint(root / name, config, state, quantize, qcfg, quant_config_file=file,
                                             dtype=torch.float16)
            for name, (quantize, qcfg, file) in CASES.items()}


@pytest.fixture(scope="module")
def oracle(llama: tuple, checkpoints: dict[str, QuantizedCheckpoint]) -> Oracles:
    return Oracles(llama[0], checkpoints)


def _input_ids() -> torch.Tensor:
    return torch.randint(4, 320, (24,), generator=torch.Generator().manual_seed(5))


def _load(path: Path, **kwargs: Any) -> torch.nn.Module:
    return get_model(create_engine_config(model=str(path), device="cpu", dtype="float32", use_tqdm_on_load=False,
                                          **kwargs))


@pytest.mark.parametrize("name", list(CASES))
def test_tp1_logits_match_transformers_on_dequantised_weights(name: str, checkpoints: dict, oracle: Callable) -> None:
    ckpt = checkpoints[name]
    model = _load(ckpt.path)
    ids = _input_ids()
    torch.testing.assert_close(compute_logits_on_rank(model, ids), hf_logits(oracle(name), ids),
                               atol=LOGITS_ATOL, rtol=LOGITS_ATOL)
    report = quantized_linear_report(model)
    # Only the WNA16 layout remains: no checkpoint tensor, no float weight.
    assert set(report["first_linear_tensors"]) <= LAYOUT_BUFFERS | {"wna16_input_perm"}, report
    assert LAYOUT_BUFFERS <= set(report["first_linear_tensors"]), report
    ratio = report["linear_bytes"] / ckpt.quantized_bytes
    assert 0.9 < ratio < 1.1, (name, report["linear_bytes"], ckpt.quantized_bytes)
    # The whole model: the checkpoint's bytes (embeddings and LM head upcast from float16
    # to the float32 model dtype), plus the RoPE tables.
    assert report["model_bytes"] < 1.1 * (ckpt.quantized_bytes + 2 * ckpt.other_bytes) + (1 << 20)


def test_desc_act_inputs_are_permuted_once_and_int8_codes_are_bytes(checkpoints: dict) -> None:
    model = _load(checkpoints["gptq4_g32_asym_desc_act"].path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    perm = qkv.wna16_input_perm
    assert perm is not None and sorted(perm.tolist()) == list(range(256))  # a permutation, no padding at TP 1
    assert qkv.wna16_qweight.shape == (qkv.output_size, 128) and qkv.wna16_qweight.dtype == torch.uint8
    assert qkv.wna16_scales.dtype == torch.float16  # the checkpoint's scales, kept exactly
    assert qkv.wna16_scales.shape == (qkv.output_size, 256 // 32)
    model8 = _load(checkpoints["gptq8_channel_sym"].path)
    down = model8.model.layers[1].mlp.down_proj
    assert down.wna16_input_perm is None and down.wna16_qweight.shape == (256, 512)
    assert down.wna16_scales.shape == (256, 1)


@pytest.mark.parametrize("name", ["gptq4_g32_asym_desc_act", "awq_g128_file"])
def test_tp1_greedy_tokens_match_transformers(name: str, checkpoints: dict, oracle: Callable) -> None:
    prompts = make_prompts(320, seed=3, lens=(5, 17))
    assert_engine_greedy_matches(checkpoints[name].path, oracle(name), prompts, MAX_NEW)


@pytest.mark.slow
def test_tp2_logits_and_resident_bytes_per_rank(checkpoints: dict, oracle: Callable) -> None:
    ids = _input_ids()
    cases = [{"name": n, "model": str(checkpoints[n].path), "input_ids": ids} for n in TP2_CASES]
    # group 256 leaves o_proj's 128 inputs per rank without whole groups
    cases.append({"name": "gptq_g256_tp2", "model": str(checkpoints["gptq4_g128_sym"].path), "input_ids": ids,
                  "expect_error": True})
    g256 = checkpoints["gptq4_g128_sym"].path.parent / "gptq_g256"
    if not g256.exists():
        g256.mkdir()
        for f in checkpoints["gptq4_g128_sym"].path.iterdir():
            (g256 / f.name).symlink_to(f)
        (g256 / "config.json").unlink()
        cfg = json.loads((checkpoints["gptq4_g128_sym"].path / "config.json").read_text())
        cfg["quantization_config"]["group_size"] = 256
        (g256 / "config.json").write_text(json.dumps(cfg))
    cases[-1]["model"] = str(g256)
    results = run_tp(tp_load_quantized, 2, cases)
    for name in TP2_CASES:
        expected = hf_logits(oracle(name), ids)
        for rank, res in enumerate(results):
            got = res[name]
            torch.testing.assert_close(got["logits"], expected, atol=LOGITS_ATOL, rtol=LOGITS_ATOL)
            share = checkpoints[name].quantized_bytes / 2
            ratio = got["linear_bytes"] / share
            print(f"{name} rank {rank}: linear bytes / checkpoint share = {ratio:.3f}")
            assert 0.9 < ratio < TP2_BYTES_BOUND.get(name, 1.1), (name, rank, got["linear_bytes"], share)
            assert set(got["first_linear_tensors"]) <= LAYOUT_BUFFERS | {"wna16_input_perm"}
    for res in results:
        kind, message = res["gptq_g256_tp2"]
        assert kind == "ValueError" and "group_size=256" in message and "tensor_parallel_size=2" in message, message


@pytest.mark.slow
def test_tp2_engine_greedy_tokens_match_transformers(checkpoints: dict, oracle: Callable) -> None:
    name = "gptq4_g32_asym_desc_act"
    prompts = make_prompts(320, seed=4, lens=(6, 13))
    assert_engine_greedy_matches(checkpoints[name].path, oracle(name), prompts, MAX_NEW, tensor_parallel_size=2)


# ---------------------------------------------------------------------- refusals


def _with_quant_config(src: Path, dst: Path, qcfg: dict[str, Any], file: str | None = None) -> Path:
    """A copy of checkpoint `src` (config.json only; the refusals never read the weights)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if file is None:
        cfg["quantization_config"] = qcfg
    else:
        (dst / file).write_text(json.dumps(qcfg))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


REFUSALS = [
    ({**_gptq(3, 128, True, False)}, None, r"quantization_config\.bits=3"),
    ({**_gptq(4, 16, True, False)}, None, r"quantization_config\.group_size=16"),
    ({**_gptq(4, 128, True, False), "checkpoint_format": "marlin"}, None,
     r"quantization_config\.checkpoint_format='marlin'"),
    ({**_gptq(4, 128, True, False), "is_marlin_format": True}, None, r"quantization_config\.is_marlin_format"),
    ({**_gptq(4, 128, True, False), "lm_head": True}, None, r"quantization_config\.lm_head"),
    ({"bits": 2, "group_size": 128, "desc_act": False}, "quantize_config.json", r"quantization_config\.bits=2"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}, None,
     r"quantization_config\.version='gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False, "version": "gemm"}, None,
     r"quantization_config\.zero_point=False"),
    ({"w_bit": 8, "q_group_size": 128, "zero_point": True, "version": "gemm"}, "quant_config.json",
     r"quantization_config\.w_bit=8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 100, "zero_point": True, "version": "gemm"}, None,
     r"quantization_config\.group_size=100"),
]


@pytest.mark.parametrize("qcfg,file,match", REFUSALS, ids=[m.split("\\.")[-1] for _, _, m in REFUSALS])
def test_unsupported_settings_are_refused_naming_the_field(qcfg: dict, file: str | None, match: str,
                                                           checkpoints: dict, tmp_path: Path) -> None:
    model = _with_quant_config(checkpoints["gptq4_g128_sym"].path, tmp_path / "m", qcfg, file)
    with pytest.raises(ConfigError, match=match):
        create_engine_config(model=str(model), device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gptq4_g32_asym_desc_act", "awq_g64"])
def test_cuda_logits_match_transformers_on_dequantised_weights(name: str, checkpoints: dict, oracle: Oracles) -> None:
    model = get_model(create_engine_config(model=str(checkpoints[name].path), device="cuda", dtype="float32",
                                           use_tqdm_on_load=False))
    ids = _input_ids()
    logits = compute_logits_on_rank(model, ids.cuda()).cpu()
    torch.testing.assert_close(logits, hf_logits(oracle(name), ids), atol=LOGITS_ATOL, rtol=LOGITS_ATOL)
