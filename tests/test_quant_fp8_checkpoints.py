"""Serialized fp8 checkpoints: native fp8 (`quant_method: "fp8"`, DeepSeek-V3 / Qwen3-FP8
layout) and compressed-tensors FP8, against transformers on the dequantised weights.

Each checkpoint is a tiny random Llama (tests/quant_checkpoints.py: hidden 256,
intermediate 512, 2 layers, heads of 64) whose linear weights this test quantises to
float8_e4m3fn with its own reference quantiser, following each format's layout:
`weight` [out, in] e4m3 plus `weight_scale_inv` [ceil(out/bn), ceil(in/bk)] float32
(blocks), `weight_scale` [] (native per tensor), [out, 1] (compressed-tensors
channel), [1] (tensor) or blocks. The oracle is transformers holding q * scale in
float32. With float32 activations our CPU path (weight tiles dequantised, activations
left unquantised) computes exactly those products, so logits agree to float32
summation order (1e-4). At TP 2 a rank's shard must hold whole scale blocks, and when
it cannot, the load is refused naming weight_block_size and tensor_parallel_size.
Resident bytes: each rank's linear layers hold its share of the checkpoint's fp8
bytes (1 byte per weight plus the scales), not a float copy.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from config import ConfigError
from engine.arg_utils import create_engine_config
from models.layers import cpu_bf16_gemm, cpu_sgemm
from models.layers.cpu_gemm import widens_half_dtype
from models.layers.quantization.fp8_kernels import BF16_MAX_ROWS, dequant_rows_torch, fp8_linear
from models.layers.quantization.fp8_kernels import load as load_fp8_kernel
from tests.conftest import run_tp
from tests.quant_checkpoints import (
    hf_model_from_state_dict,
    random_llama_state_dict,
    tiny_llama_config,
    write_quantized_checkpoint,
)
from tests.quant_tp_helpers import hf_logits, load_case, tp_quant_cases

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LOGITS_ATOL = 1e-4
INPUT_IDS = torch.randint(3, 320, (12,), generator=torch.Generator().manual_seed(5))


def quantize_fp8_blocks(weight: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] e4m3, scale [ceil(out/bn), ceil(in/bk)] float32) with each block's
    largest magnitude mapped to 448 (partial blocks at the edges scaled by their own
    max); per channel is (1, in), per tensor (out, in)."""
    out_f, in_f = weight.shape
    rows, cols = -(-out_f // block_n), -(-in_f // block_k)
    padded = torch.zeros(rows * block_n, cols * block_k)
    padded[:out_f, :in_f] = weight
    blocks = padded.reshape(rows, block_n, cols, block_k)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(rows * block_n, cols * block_k)[:out_f, :in_f].contiguous(), scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    s = scale.repeat_interleave(block_n, 0)[: q.shape[0]].repeat_interleave(block_k, 1)[:, : q.shape[1]]
    return q.float() * s


def fp8_quantizer(strategy: str, scale_name: str, block: tuple[int, int] = (128, 128), ignore: tuple[str, ...] = (),
                  tensor_scale_shape: tuple[int, ...] = (1,)):
    """The checkpoint's tensors for one module: blocks (scale [rows, cols]), channel
    ([out, 1]) or tensor (`tensor_scale_shape`: compressed-tensors writes [1], native
    fp8 checkpoints []); modules ending in an `ignore` entry stay float."""
    def quantize(module: str, weight: torch.Tensor):
        if any(module.endswith(name) for name in ignore):
            return None
        out_f, in_f = weight.shape
        bn, bk = {"block": block, "channel": (1, in_f), "tensor": (out_f, in_f)}[strategy]
        q, scale = quantize_fp8_blocks(weight, bn, bk)
        stored = scale.reshape(tensor_scale_shape) if strategy == "tensor" else scale
        return {"weight": q, scale_name: stored}, dequantize_fp8_blocks(q, scale, bn, bk)

    return quantize


def ct_fp8_config(strategy: str, activations: bool, block: list[int] | None = None) -> dict[str, Any]:
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                               "dynamic": False}
    if block is not None:
        weights["block_structure"] = block
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if activations:
        group["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                      "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


# name -> (config overrides, quantizer, quantization_config)
CHECKPOINTS: dict[str, tuple[dict[str, Any], Any, dict[str, Any]]] = {
    # DeepSeek-V3 / Qwen3-FP8: 128x128 blocks; 4 KV heads so every TP 2 shard holds whole blocks.
    "native_block": ({"num_key_value_heads": 4}, fp8_quantizer("block", "weight_scale_inv"),
                     {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": [128, 128]}),
    # 2 KV heads: k/v are 128 wide (64 per rank at TP 2, half a block).
    "native_block_kv2": ({}, fp8_quantizer("block", "weight_scale_inv"),
                         {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    # Column blocks of 96: 256 and 512 inputs end in partial blocks.
    "native_block_partial": ({"num_key_value_heads": 4}, fp8_quantizer("block", "weight_scale_inv", (128, 96)),
                             {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 96]}),
    # Per-tensor scales (one per checkpoint module, fused by qkv_proj / gate_up_proj), one layer left float.
    "native_tensor": ({}, fp8_quantizer("tensor", "weight_scale", ignore=("layers.1.mlp.down_proj",),
                                                   tensor_scale_shape=()),
                      {"quant_method": "fp8", "activation_scheme": "dynamic",
                       "ignored_layers": ["model.layers.1.mlp.down_proj"]}),
    "ct_channel_dynamic": ({}, fp8_quantizer("channel", "weight_scale"), ct_fp8_config("channel", True)),
    "ct_block": ({"num_key_value_heads": 4}, fp8_quantizer("block", "weight_scale"),
                 ct_fp8_config("block", True, [128, 128])),
    "ct_tensor_w8a16": ({}, fp8_quantizer("tensor", "weight_scale"), ct_fp8_config("tensor", False)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Any]:
    """name -> (QuantizedCheckpoint, transformers' logits on its dequantised weights)."""
    root = tmp_path_factory.mktemp("fp8_ckpts")
    out = {}
    for seed, (name, (overrides, quantizer, qconfig)) in enumerate(CHECKPOINTS.items()):
        config = tiny_llama_config(**overrides)
        state = random_llama_state_dict(config, seed=100 + seed)
        ckpt = write_quantized_checkpoint(root / name, config, state, quantizer, qconfig)
        out[name] = (ckpt, hf_logits(hf_model_from_state_dict(config, ckpt.dequantized), INPUT_IDS))
    return out


def case(name: str, checkpoints: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": str(checkpoints[name][0].path), "input_ids": INPUT_IDS, **extra}


def check_loaded(name: str, result: dict[str, Any], checkpoints: dict[str, Any], tp_size: int) -> None:
    ckpt, expected = checkpoints[name]
    torch.testing.assert_close(result["logits"], expected, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    # Resident: this rank's share of the checkpoint's fp8 weights and scales (row-parallel
    # layers replicate their per-channel scales: a little over 1/tp).
    share = ckpt.quantized_bytes / tp_size
    assert 0.98 * share <= result["linear_bytes"] <= 1.04 * share, (name, result["linear_bytes"], share)
    fp8_layers = [n for n, d in result["dtypes"].items() if d == "torch.float8_e4m3fn"]
    assert len(fp8_layers) >= 7, (name, result["dtypes"])  # 8 linear layers; native_tensor leaves one float


# ------------------------------------------------------------------ kernels


def test_the_registry_sends_an_fp8_checkpoint_to_its_own_config_and_online_fp8_to_fp8config():
    """quantization="fp8" names two configs: `Fp8Config` quantises a full-precision
    checkpoint online, `Fp8CheckpointConfig` reads one already in fp8; the registry picks
    by whether the checkpoint has a quantization_config, and `Fp8Config` refuses one."""
    from models.layers.quantization import get_quantization_config
    from models.layers.quantization.fp8 import Fp8Config
    from models.layers.quantization.fp8_checkpoint import Fp8CheckpointConfig

    assert type(get_quantization_config("fp8", None)) is Fp8Config
    settings = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert type(get_quantization_config("fp8", settings)) is Fp8CheckpointConfig
    with pytest.raises(ValueError, match="Fp8CheckpointConfig"):
        Fp8Config.from_config(settings)


@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-5])
def test_fp8_dequant_kernel_is_exact_for_every_byte(scale):
    """Every e4m3 byte (subnormals, both zeros, NaN) times a scale, rounded once to the
    tile's dtype, as torch's `q.float() * s` then `.to(dtype)`."""
    kernel = load_fp8_kernel()
    assert kernel is not None, "the fp8 tile kernel builds on this machine"
    every = torch.arange(256, dtype=torch.uint8).view(FP8).reshape(2, 128)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(2, 128, dtype=dtype)
        kernel.dequant_rows(every, 0, 2, torch.full((2, 1), scale), 1, 128, out)
        expected = (every.to(torch.float32) * scale).to(dtype)
        assert torch.equal(out.float().nan_to_num(7.0), expected.float().nan_to_num(7.0)), dtype


@pytest.mark.parametrize("rows", range(1, 17))
def test_fp8_gemv_reads_every_byte(rows):
    """The GEMV (each row count up to 8 its own copy, 9-16 rows in two passes) over weight
    rows holding every e4m3 byte: a row with a NaN byte gives NaN, the others the
    float64 product of the exact values."""
    kernel = load_fp8_kernel()
    every = torch.arange(256, dtype=torch.uint8)
    finite = every[(every & 0x7F) != 0x7F]
    finite = torch.cat([finite, torch.zeros(2, dtype=torch.uint8)])  # 254 finite bytes and two zeros
    weight = torch.stack([every.roll(17 * i) for i in range(3)] + [finite.roll(5), finite.flip(0)])
    weight = weight.view(FP8).contiguous()  # [5, 256]: rows 0-2 hold both NaN bytes, rows 3-4 none
    scale = torch.tensor([[0.5, 2.0], [0.25, 1.5], [1.0, 1.0]])  # blocks of 2 rows x 128
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    out = kernel.gemv(x, weight, scale, 2, 128, torch.float32)
    assert out[:, :3].isnan().all()
    ref = x.double() @ dequantize_fp8_blocks(weight, scale, 2, 128)[3:].double().t()
    torch.testing.assert_close(out[:, 3:].double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)  # float32 sums


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((70, 33), (1, 33)), ((1000, 600), (128, 96))])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 16, 20])  # the direct fp8 GEMV (<= 16 rows) and dequantised tiles
def test_fp8_linear_matches_float64(shape, block, rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(*shape, generator=gen)
    q, scale = quantize_fp8_blocks(w, *block)
    x = torch.randn(rows, shape[1], generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    ref = x.double() @ dequantize_fp8_blocks(q, scale, *block).double().t() + bias.double()
    assert torch.equal(dequant_rows_torch(q, 0, shape[0], scale, *block, torch.float32),
                       dequantize_fp8_blocks(q, scale, *block))
    got = fp8_linear(x, q, scale, *block, bias)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
    # The portable path (no C kernel) gives the same products.
    monkeypatch.setenv("TP_CPU_FP8_DEQUANT", "0")
    load_fp8_kernel.cache_clear()
    try:
        torch.testing.assert_close(fp8_linear(x, q, scale, *block, bias).double(), ref, atol=1e-4, rtol=1e-5)
    finally:
        monkeypatch.delenv("TP_CPU_FP8_DEQUANT")
        load_fp8_kernel.cache_clear()
    # bf16 activations: one bf16 rounding per weight and per activation.
    got_bf16 = fp8_linear(x.bfloat16(), q, scale, *block, bias)
    assert got_bf16.dtype == torch.bfloat16
    assert ((got_bf16.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("switch", ["1", "0"], ids=["kernel-on", "TP_CPU_BF16_GEMM=0"])
def test_fp8_tiles_in_16_bits_take_the_product_a_dense_layer_takes(monkeypatch, switch):
    """bf16 tiles (batches past the GEMV and past fp8_bf16.c's rows) go through our kernel
    where a bf16 dense layer does, one call per tile: the AVX2 one on a CPU whose oneDNN
    has no bf16 GEMM (torch's product converts each tile on every call there),
    cpu_bf16_gemm on AVX-512 BF16 CPUs (oneDNN's reorders each tile); F.linear elsewhere,
    and wherever `TP_CPU_BF16_GEMM=0` turns the dense layers' kernel off. The products as
    above."""
    monkeypatch.setenv("TP_CPU_BF16_GEMM", switch)
    gen = torch.Generator().manual_seed(4)
    q, scale = quantize_fp8_blocks(torch.randn(1000, 600, generator=gen), 128, 96)
    x = torch.randn(BF16_MAX_ROWS + 8, 600, generator=gen)
    calls, bf16_calls = [], []
    real_half, real_bf16 = cpu_sgemm.linear_half, cpu_bf16_gemm.linear
    monkeypatch.setattr(cpu_sgemm, "linear_half", lambda a, w, *r: calls.append(w.shape[0]) or real_half(a, w, *r))
    monkeypatch.setattr(cpu_bf16_gemm, "linear", lambda a, w, *r: bf16_calls.append(w.shape[0]) or real_bf16(a, w, *r))
    got = fp8_linear(x.bfloat16(), q, scale, 128, 96)
    assert sum(calls) == (1000 if widens_half_dtype(torch.bfloat16) else 0)
    assert sum(bf16_calls) == (1000 if switch == "1" and cpu_bf16_gemm.load() is not None else 0)
    if switch == "0":
        assert not calls and not bf16_calls
    ref = x.double() @ dequantize_fp8_blocks(q, scale, 128, 96).double().t()
    assert got.dtype == torch.bfloat16 and ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


# ------------------------------------------------------------------ models, TP 1


@pytest.mark.parametrize("name", ["native_block", "native_block_partial", "native_tensor", "ct_channel_dynamic",
                                  "ct_block", "ct_tensor_w8a16"])
def test_fp8_checkpoint_matches_transformers_on_dequantised_weights(name, checkpoints):
    result = load_case(case(name, checkpoints))
    check_loaded(name, result, checkpoints, 1)
    if name == "native_tensor":
        assert "Unquantized" in result["methods"]["model.layers.1.mlp.down_proj"]
        assert result["dtypes"]["model.layers.1.mlp.down_proj"] == "torch.float32"


def test_fp8_greedy_decoding_agrees_with_transformers(checkpoints):
    """Greedy steps through the whole engine: the decode steps' single rows take the
    direct fp8 GEMV."""
    from config import SamplingParams
    from engine.core import EngineCore

    ckpt = checkpoints["native_block"][0]
    config = tiny_llama_config(num_key_value_heads=4)
    hf = hf_model_from_state_dict(config, ckpt.dequantized)
    prompt = INPUT_IDS[:6].tolist()
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                             max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    with EngineCore(model=str(ckpt.path), device="cpu", dtype="float32", kv_cache_memory_bytes=1 << 22,
                    max_model_len=64, use_tqdm_on_load=False) as core:
        outs = core.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert outs[0].token_ids == hf_out[0, 6:].tolist()


def test_bf16_activations_stay_close(checkpoints):
    result = load_case(case("native_block", checkpoints, kwargs={"dtype": "bfloat16"}))
    expected = checkpoints["native_block"][1]
    err = ((result["logits"].float() - expected).norm() / expected.norm()).item()
    assert err < 0.02, err


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("qconfig,match", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme='static'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    ({**ct_fp8_config("channel", True), "config_groups": {"group_0": {
        **ct_fp8_config("channel", True)["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     r"input_activations.dynamic=False"),
    ({**ct_fp8_config("group", False)}, r"weights.strategy='group'"),
])
def test_unsupported_fp8_configs_are_refused(qconfig, match, checkpoints, tmp_path):
    src = checkpoints["ct_tensor_w8a16"][0].path
    dst = Path(tmp_path) / "ckpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        create_engine_config(model=str(dst), device="cpu")


# ------------------------------------------------------------------ TP 2


@pytest.mark.slow
def test_fp8_checkpoints_tp2(checkpoints):
    """Block scales split by whole blocks, per-tensor scales per fused shard, per-channel
    scales by rows; partial blocks at a shard boundary are refused."""
    names = ["native_block", "native_tensor", "ct_channel_dynamic"]
    refused = {"native_block_kv2": r"output sizes per rank \[128, 64, 64\]",
               "native_block_partial": r"input size per rank 128"}
    cases = [case(n, checkpoints) for n in names] + [case(n, checkpoints, expect_error=True) for n in refused]
    results = run_tp(tp_quant_cases, 2, cases)
    for rank_result in results:
        for name in names:
            check_loaded(name, rank_result[name], checkpoints, 2)
        for name, match in refused.items():
            kind, message = rank_result[name]["error"]
            assert kind == "ValueError", (name, kind, message)
            for needle in ("weight_block_size", "tensor_parallel_size=2", match):
                assert re.search(needle, message), (name, needle, message)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_fp8_checkpoint_method_on_cuda(strategy):
    """Per-channel layers with dynamic fp8 activations use torch._scaled_mm where the GPU
    has it (within fp8 activation rounding of the dequantised product); blocks take the
    Triton GEMM that reads the fp8 bytes (exact products, bf16 rounding of the weights)."""
    from types import SimpleNamespace

    from models.layers.quantization.fp8_checkpoint import Fp8CheckpointLinearMethod

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=gen)
    block = (128, 128) if strategy == "block" else (1, 384)
    q, scale = quantize_fp8_blocks(w, *block)
    method = Fp8CheckpointLinearMethod(strategy, block if strategy == "block" else None, "weight_scale", True)
    layer = SimpleNamespace(weight=q.cuda(), weight_scale=scale.cuda())
    x = torch.randn(8, 384, generator=gen)
    ref = x.double() @ dequantize_fp8_blocks(q, scale, *block).double().t()
    got = method.apply(layer, x.cuda().bfloat16()).double().cpu()
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
