"""GGUF files kept in their block formats (models/layers/quantization/gguf.py).

The files are written by tests/test_gguf.py's writer (llama.cpp's names and q/k row
permutation); K-quant blocks by tests/gguf_kquants.py, whose output gguf-py (the
independent reader) dequantises here. The oracle is transformers on the dequantised
weights (gguf-py's values put back into a float32 checkpoint).

Tolerances: the kernels dequantise each block exactly as gguf-py does (checked bit for
bit) and accumulate in float32 with fused multiply-adds in 16 running sums per token,
so a product differs from F.linear on the dequantised weight by float32 rounding only
(relative 1e-5 of the row's |w|.|x|); the tiny models' logits then match transformers
to 1e-4, as the float32 GGUF tests do.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from config import ConfigError
from engine.arg_utils import create_engine_config
from engine.tiny_model import make_tiny_model
from models.layers import cpu_sgemm
from models.layers.quantization import get_quantization_config, gguf_kernels
from models.layers.quantization.gguf_dequant import (
    QUANTIZED_TYPES,
    dequantize,
    row_bytes,
)
from tests.conftest import run_tp
from tests.gguf_kquants import quantize as quantize_blocks
from tests.gguf_tp import gguf_tp_cases, resident_bytes
from tests.test_gguf import (
    dequantised_checkpoint,
    load,
    plain_weight,
    transformers_logits,
    write_gguf,
)
from tests.tp_helpers import compute_logits_on_rank

Q = gguf.GGMLQuantizationType
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# A Q4_K_M-style mix: q/k/v and gate/up each of different types, a kernel-less Q5_0 in the
# fused gate/up of layer 1 (held dequantised), an F16 shard in layer 0's q/k/v.
MIXED = {
    "model.embed_tokens.weight": "Q4_K", "lm_head.weight": "Q6_K",
    "model.layers.0.self_attn.q_proj.weight": "Q4_K", "model.layers.0.self_attn.k_proj.weight": "F16",
    "model.layers.0.self_attn.v_proj.weight": "Q6_K", "model.layers.0.self_attn.o_proj.weight": "Q5_K",
    "model.layers.0.mlp.gate_proj.weight": "Q4_K", "model.layers.0.mlp.up_proj.weight": "Q8_0",
    "model.layers.0.mlp.down_proj.weight": "Q6_K",
    "model.layers.1.self_attn.q_proj.weight": "Q8_0", "model.layers.1.self_attn.k_proj.weight": "Q4_0",
    "model.layers.1.self_attn.v_proj.weight": "Q5_K", "model.layers.1.self_attn.o_proj.weight": "Q4_K",
    "model.layers.1.mlp.gate_proj.weight": "Q5_0", "model.layers.1.mlp.up_proj.weight": "Q4_K",
    "model.layers.1.mlp.down_proj.weight": "Q4_0",
}


@pytest.fixture(scope="module")
def kquant_llamas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Llamas whose every matrix is whole 256-blocks per rank at TP 2 (hidden 512,
    intermediate 512), untied and tied."""
    root = tmp_path_factory.mktemp("kquant_llamas")
    spec = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 320, "init_std": 0.05, "with_tokenizer": False}
    return {"untied": make_tiny_model(root / "untied", "llama", seed=21, tie_word_embeddings=False, **spec),
            "tied": make_tiny_model(root / "tied", "llama", seed=22, tie_word_embeddings=True, **spec)}


IDS = torch.tensor([1, 17, 250, 3, 99, 318, 42, 7, 200, 5])


def file_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the file's 2-D tensors, bytes of its 1-D ones)."""
    reader = gguf.GGUFReader(path)
    two_d = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 2)
    return two_d, sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 1)


def check_against_oracle(path: Path, hf_dir: Path, qtype: str, tmp_path: Path,
                         types: dict[str, str] | None = None) -> tuple[torch.nn.Module, Path]:
    """Our TP=1 load of `path` against transformers on its dequantised weights: the
    model and the oracle's checkpoint directory."""
    model = load(path)
    logits = compute_logits_on_rank(model, IDS)
    oracle = dequantised_checkpoint(hf_dir, qtype, tmp_path, types)
    expected = transformers_logits(oracle, IDS)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    return model, oracle


# ------------------------------------------------------------------ formats and kernels


@pytest.mark.parametrize("qtype", K_TYPES)
def test_kquant_writer_blocks_read_back_by_gguf_py(qtype):
    data = (torch.randn(8, 512, generator=torch.Generator().manual_seed(1)) * 0.2).numpy()
    blocks = quantize_blocks(data, qtype)
    assert blocks.shape == (8, row_bytes(qtype, 512)) and blocks.dtype == np.uint8
    values = gguf.quants.dequantize(blocks, Q[qtype])
    rel = np.linalg.norm(values - data) / np.linalg.norm(data)
    assert rel < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[qtype], rel


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
def test_dequantisers_equal_gguf_py_bit_for_bit(qtype):
    data = (torch.randn(6, 512, generator=torch.Generator().manual_seed(2)) * 0.3).numpy()
    blocks = quantize_blocks(data, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, Q[qtype]))
    t = torch.from_numpy(blocks)
    assert torch.equal(dequantize(qtype, t, 512), expected)  # the torch path (CUDA, no compiler)
    ids = torch.tensor([5, 0, 3, 3])
    assert torch.equal(gguf_kernels.gguf_dequantize_rows(qtype, t, 512, ids), expected[ids])


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("tokens", [1, 5, 16, 40])
def test_kernel_matches_linear_on_dequantised_weight(qtype, tokens):
    g = torch.Generator().manual_seed(3)
    data = (torch.randn(48, 768, generator=g) * 0.3).numpy()
    blocks = torch.from_numpy(quantize_blocks(data, qtype))
    weight = dequantize(qtype, blocks, 768)
    x = torch.randn(tokens, 768, generator=g)
    out = torch.full((tokens, 60), float("nan"))
    gguf_kernels.gguf_linear(qtype, blocks, 768, x, out[:, 5:53])  # a shard's columns of a wider output
    scale = (x.abs() @ weight.abs().t())
    assert ((out[:, 5:53] - F.linear(x, weight)).abs() <= 1e-5 * scale + 1e-6).all()
    assert out[:, :5].isnan().all() and out[:, 53:].isnan().all()


def test_torch_path_when_the_kernels_are_unavailable(monkeypatch):
    monkeypatch.setattr(gguf_kernels, "load", lambda: None)
    data = (torch.randn(16, 256, generator=torch.Generator().manual_seed(4)) * 0.3).numpy()
    blocks = torch.from_numpy(quantize_blocks(data, "Q4_K"))
    x = torch.randn(3, 256)
    out = torch.empty(3, 16)
    gguf_kernels.gguf_linear("Q4_K", blocks, 256, x, out)
    torch.testing.assert_close(out, F.linear(x, dequantize("Q4_K", blocks, 256)), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ the engine, TP 1


@pytest.mark.parametrize("qtype", K_TYPES)
def test_kquant_file_matches_dequantised_oracle_and_stays_quantised(qtype, kquant_llamas, tmp_path):
    path = write_gguf(kquant_llamas["untied"], tmp_path / f"{qtype}.gguf", qtype)
    model, _ = check_against_oracle(path, kquant_llamas["untied"], qtype, tmp_path)
    # Every matrix, the embedding and the LM head included, is held as the file's blocks.
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("proj.weight") for n in names)
    assert "model.embed_tokens.qweight" in names and "lm_head.qweight" in names
    assert model.lm_head.qweight.dtype == torch.uint8
    two_d, one_d = file_bytes(path)
    assert resident_bytes(model) == two_d + one_d  # vocab 320 needs no padding rows


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_legacy_quants_held_as_blocks(qtype, tiny_models, tmp_path):
    path = write_gguf(tiny_models["llama"], tmp_path / f"{qtype}.gguf", qtype)
    model, _ = check_against_oracle(path, tiny_models["llama"], qtype, tmp_path)
    two_d, one_d = file_bytes(path)
    assert resident_bytes(model) == two_d + one_d


def test_mixed_q4_k_m_style_file(kquant_llamas, tmp_path, caplog):
    path = write_gguf(kquant_llamas["untied"], tmp_path / "mixed.gguf", "Q4_K_M", tensor_types=MIXED)
    with caplog.at_level(logging.WARNING, logger="model_loader.gguf_quant"):
        model, oracle = check_against_oracle(path, kquant_llamas["untied"], "Q4_K_M", tmp_path, MIXED)
    assert "Q5_0" in caplog.text  # the kernel-less type is named and held dequantised
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.shard_types == ["Q4_K", "F16", "Q6_K"]
    assert model.model.layers[1].mlp.gate_up_proj.quant_method.shard_types == ["F32", "Q4_K"]
    # The exact values of one mixed fused layer, rows in HF order (the un-permute moved whole rows).
    ref = load_file(str(oracle / "model.safetensors"))
    qkv = plain_weight(model.model.layers[1].self_attn.qkv_proj)
    expect = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expect)


def test_tied_embedding_is_the_lm_head_and_stays_quantised(kquant_llamas, tmp_path):
    path = write_gguf(kquant_llamas["tied"], tmp_path / "tied.gguf", "Q6_K")
    model, _ = check_against_oracle(path, kquant_llamas["tied"], "Q6_K", tmp_path)
    assert model.lm_head.qweight is model.model.embed_tokens.qweight
    table = plain_weight(model.model.embed_tokens)
    ids = torch.tensor([0, 319, 7, 7])
    torch.testing.assert_close(model.model.embed_tokens(ids), table[ids], atol=0, rtol=0)


# ------------------------------------------------------------------ refusals


def test_tp_that_splits_blocks_is_refused(tmp_path):
    hf = make_tiny_model(tmp_path / "h256", "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128, with_tokenizer=False)
    path = write_gguf(hf, tmp_path / "h256.gguf", "Q4_K")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 .*o_proj \(Q4_K, blocks of 256"):
        create_engine_config(model=str(path), device="cpu", tensor_parallel_size=2)


def test_bad_gguf_quantization_config_is_refused(tiny_models):
    with pytest.raises(ValueError, match="quantization_config.tensor_types .*IQ2_XS"):
        get_quantization_config("gguf", {"quant_method": "gguf", "tensor_types": {"lm_head": "IQ2_XS"}})
    with pytest.raises(ConfigError, match="quantization='gguf'"):
        create_engine_config(model=str(tiny_models["llama"]), device="cpu", quantization="gguf")


def test_float_gguf_keeps_the_plain_method(gguf_f16_path):
    config = create_engine_config(model=str(gguf_f16_path), device="cpu")
    assert config.model_config.quantization is None
    assert not hasattr(config.model_config.hf_config, "quantization_config")


@pytest.fixture
def gguf_f16_path(tiny_models, tmp_path) -> Path:
    return write_gguf(tiny_models["llama"], tmp_path / "f16.gguf", "F16")


# ------------------------------------------------------------------ TP 2


@pytest.mark.slow
def test_quantised_gguf_tp2_matches_oracle_and_halves_memory(kquant_llamas, tmp_path):
    cases, expected, budgets = [], {}, {}
    for name, qtype, types in (("q4_k", "Q4_K", None), ("mixed", "Q4_K_M", MIXED)):
        path = write_gguf(kquant_llamas["untied"], tmp_path / f"{name}.gguf", qtype, tensor_types=types)
        cases.append({"name": name, "model": str(path), "input_ids": IDS})
        (tmp_path / name).mkdir()
        oracle = dequantised_checkpoint(kquant_llamas["untied"], qtype, tmp_path / name, types)
        expected[name] = transformers_logits(oracle, IDS)
        two_d, one_d = file_bytes(path)
        # This rank's share: half of every matrix (2 KV heads, one per rank) plus the norms.
        budgets[name] = two_d // 2 + one_d
    results = run_tp(gguf_tp_cases, 2, cases)
    for rank, res in enumerate(results):
        for name, logits in expected.items():
            got = res[name]
            assert got["num_heads"] == 2 and got["num_kv_heads"] == 1 and got["embed_rows"] == 160
            torch.testing.assert_close(got["logits"], logits, atol=1e-4, rtol=1e-4)
            assert "torch.uint8" in got["param_dtypes"]
            # The mixed file's Q5_0 gate [512, 512] (22 bytes per 32 values) is held as F32, half per rank.
            extra = (512 * 512 * 4 - 512 * 512 // 32 * 22) // 2 if name == "mixed" else 0
            assert got["resident_bytes"] == budgets[name] + extra, (rank, name, got["resident_bytes"], budgets[name])


def test_quantised_gguf_tp2_in_bfloat16_tracks_the_oracle(kquant_llamas, tmp_path):
    """A Q4_K_M-style file at TP=2 in bfloat16: its 10-token prefill through the int8
    tiles on each rank's shards (a row-parallel layer's K split in whole 256-blocks, so
    each rank quantises the same 32s of x), its logits within bfloat16's and int8's error
    of transformers on the dequantised weights, as the TP=1 load's are."""
    path = write_gguf(kquant_llamas["untied"], tmp_path / "mixed.gguf", "Q4_K_M", tensor_types=MIXED)
    oracle = dequantised_checkpoint(kquant_llamas["untied"], "Q4_K_M", tmp_path, MIXED)
    expected = transformers_logits(oracle, IDS)
    single = compute_logits_on_rank(load(path, dtype="bfloat16"), IDS).float()
    results = run_tp(gguf_tp_cases, 2, [{"name": "mixed", "model": str(path), "input_ids": IDS, "dtype": "bfloat16"}])
    for res in results:
        got = res["mixed"]["logits"].float()
        assert ((got - expected).norm() / expected.norm()).item() < 0.03
        assert ((got - single).norm() / single.norm()).item() < 0.03


# ------------------------------------------------------------------ int8 activations, the portable build


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("tokens", [1, 7])  # 8 and more: tests/test_gguf_int8_tiles.py, test_gguf_bf16_tiles.py
def test_16bit_activations_go_through_int8_within_their_rounding(qtype, tokens):
    """bfloat16 activations are quantised to int8 (dx = max|x| / 127) per 32 values, or
    per 256 for the K-quants (llama.cpp's Q8_K): the result is the float product with
    those rounded activations (to float32 rounding), and within sum |w| * dx / 2 of the
    product with the activations themselves."""
    g = torch.Generator().manual_seed(5)
    k = 512 + (32 if qtype in ("Q4_0", "Q8_0") else 0)  # a last 32-block alone in its 64
    group = 256 if qtype in ("Q4_K", "Q5_K", "Q6_K") else 32
    blocks = torch.from_numpy(quantize_blocks((torch.randn(24, k, generator=g) * 0.3).numpy(), qtype))
    weight = dequantize(qtype, blocks, k).double()
    x = torch.randn(tokens, k, generator=g).bfloat16()
    out = torch.empty(tokens, 24)
    gguf_kernels.gguf_linear(qtype, blocks, k, x, out)
    groups = x.double().reshape(tokens, -1, group)
    dx = groups.abs().amax(-1, keepdim=True) / 127
    bound = (weight.abs().reshape(1, 24, -1, group).sum(-1) * dx.reshape(tokens, 1, -1) / 2).sum(-1)
    assert ((out.double() - x.double() @ weight.t()).abs() <= bound + 1e-5).all()
    kernel = gguf_kernels.load()
    if kernel is not None and kernel.gemm(qtype, blocks, k, x.float(), torch.empty(tokens, 24), int8_activations=True):
        assert_int8_product(out, x, weight, group)


def assert_int8_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group: int) -> None:
    """`out` is the product of `weight` (float64) with x rounded as the int8 path rounds it,
    to float32 rounding: round(x * (127 / amax)) * (amax / 127) per `group` values, in
    IEEE float32 arithmetic (numpy's: torch's vectorised division is not always
    correctly rounded)."""
    tokens, k = x.shape
    xf = x.float().reshape(tokens, -1, group).numpy()
    amax = np.abs(xf).max(-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    rounded = torch.from_numpy(np.rint(xf * inv).astype(np.float64) * (amax / np.float32(127)).astype(np.float64))
    rounded = rounded.reshape(tokens, k)
    magnitude = rounded.abs() @ weight.abs().t()
    assert ((out.double() - rounded @ weight.t()).abs() <= 1e-6 * magnitude + 1e-6).all()


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_outputs_are_the_float32_ones_rounded_once(qtype, dtype):
    """A 16-bit layer's product is written in its dtype, each output its float32 value
    rounded once to nearest even (what `.to(dtype)` of the float32 output gives), on
    every path: int8 (up to 7 tokens), bf16 tiles (8-64), the tiled prefill GEMM (more),
    into a shard's columns of a wider output, and in one call over a fused layer's
    shards of two types."""
    g = torch.Generator().manual_seed(8)
    k = 512
    blocks = torch.from_numpy(quantize_blocks((torch.randn(30, k, generator=g) * 0.3).numpy(), qtype))
    other = torch.from_numpy(quantize_blocks((torch.randn(6, k, generator=g) * 0.3).numpy(), "Q8_0"))
    plan = gguf_kernels.shard_plan([(qtype, blocks), ("Q8_0", other)])
    for tokens in (1, 7, 8, 40, 100):
        x = (torch.randn(tokens, k, generator=g) * 2).to(dtype)
        exact = torch.full((tokens, 40), float("nan"))
        rounded = torch.full((tokens, 40), float("nan"), dtype=dtype)
        gguf_kernels.gguf_linear(qtype, blocks, k, x, exact[:, 3:33])
        gguf_kernels.gguf_linear(qtype, blocks, k, x, rounded[:, 3:33])
        assert torch.equal(rounded[:, 3:33], exact[:, 3:33].to(dtype)), tokens
        assert rounded[:, :3].isnan().all() and rounded[:, 33:].isnan().all()
        exact, rounded = torch.empty(tokens, 36), torch.empty(tokens, 36, dtype=dtype)
        if gguf_kernels.gguf_linear_shards(plan, k, x, exact):
            assert gguf_kernels.gguf_linear_shards(plan, k, x, rounded)
            assert torch.equal(rounded, exact.to(dtype)), tokens


def test_portable_build_matches_gguf_py(tmp_path, monkeypatch):
    """The kernels built without -march (no AVX-512: the portable C dequantisers, no
    VNNI) give the same dequantised values and float products."""
    from distributed.native_build import load_kernel

    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    portable = load_kernel(gguf_kernels.SOURCES, ("-O2", "-ffp-contract=off", "-fopenmp", "-fPIC"),
                           gguf_kernels.LINK_FLAGS, gguf_kernels.LINK_LIBS, gguf_kernels.GGUFKernels, "%s")
    assert portable is not None
    g = torch.Generator().manual_seed(6)
    for qtype in QUANTIZED_TYPES:
        blocks = torch.from_numpy(quantize_blocks((torch.randn(8, 256, generator=g) * 0.3).numpy(), qtype))
        expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), Q[qtype]))
        out = torch.empty(8, 256)
        portable.dequantize_rows(qtype, blocks, 256, None, out)
        assert torch.equal(out, expected), qtype
        x, y = torch.randn(3, 256, generator=g), torch.empty(3, 8)
        assert not portable.gemm(qtype, blocks, 256, x, y, int8_activations=True)  # no VNNI in this build
        assert not portable.has_int8_tiles
        assert portable.gemm(qtype, blocks, 256, x, y)
        torch.testing.assert_close(y, F.linear(x, expected), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_sgemm.cpu_has_avx2(), reason="no AVX2/FMA on this CPU")
def test_avx2_build_int8_products(gguf_avx2_kernels):
    """The kernels built for AVX2 without AVX-512 (gguf_avx2.c's int8 products and
    gguf_avx2_tiles.c's K-quant and Q8_0 tiles, as on Zen 3 or Haswell; built here
    whatever this CPU adds): every type's product with int8 activations, per 32 values for
    Q4_0/Q8_0 and for the K-quants per 256 below 8 tokens and per 32 from 8 on (as the
    AVX-512 build's tiles), token counts across the 8-token chunks and 16-row tiles (19
    rows), a fused layer's mixed shards in one call equal to one call each, and 16-bit
    outputs rounded once. tests/test_gguf_int8_tiles.py checks the tiles of the native build."""
    avx2 = gguf_avx2_kernels
    assert avx2 is not None and avx2.has_int8_tiles and not avx2.has_bf16
    assert avx2.int8_tile_types == gguf_kernels.INT8_TILE_TYPES | {"Q8_0"}
    g = torch.Generator().manual_seed(9)
    k = 768
    shards = []
    for qtype in QUANTIZED_TYPES:
        blocks = torch.from_numpy(quantize_blocks((torch.randn(19, k, generator=g) * 0.3).numpy(), qtype))
        weight = dequantize(qtype, blocks, k).double()
        shards.append((qtype, blocks))
        for tokens in (1, 3, 7, 8, 13):
            group = 32 if qtype in ("Q4_0", "Q8_0") or tokens >= gguf_kernels.INT8_TILE_MIN_TOKENS else 256
            x = (torch.randn(tokens, k, generator=g) * 2).bfloat16()
            x[0, :group] = 0  # a group of zeros: dx 0
            out = torch.full((tokens, 19), float("nan"))
            assert avx2.gemm(qtype, blocks, k, x.float(), out, int8_activations=True)
            assert_int8_product(out, x, weight, group)
            rounded = torch.empty(tokens, 19, dtype=torch.bfloat16)
            assert avx2.gemm(qtype, blocks, k, x.float(), rounded, int8_activations=True)
            assert torch.equal(rounded, out.bfloat16())
        if qtype in avx2.int8_tile_types:
            for tokens in (8, 13, 40):
                x = (torch.randn(tokens, k, generator=g) * 2).bfloat16()
                out = torch.full((tokens, 19), float("nan"))
                assert avx2.gemm_shards_int8_tiles(gguf_kernels.ShardPlan([(qtype, blocks)]), k, x, out)
                assert_int8_product(out, x, weight, 32)
    plan = gguf_kernels.ShardPlan(shards)
    x = (torch.randn(11, k, generator=g) * 2).half()
    fused = torch.empty(11, plan.rows)
    assert avx2.gemm_shards(plan, k, x, fused)
    start = 0
    for qtype, blocks in shards:
        one = torch.empty(11, blocks.shape[0])
        assert avx2.gemm_shards(gguf_kernels.ShardPlan([(qtype, blocks)]), k, x, one)
        assert torch.equal(fused[:, start:start + blocks.shape[0]], one), qtype
        start += blocks.shape[0]


def test_bfloat16_model_tracks_the_float32_one(kquant_llamas, tmp_path):
    """A bfloat16 load (int8 activations in the decode-sized products) stays within
    bfloat16's own error of the float32 load of the same file."""
    path = write_gguf(kquant_llamas["untied"], tmp_path / "q4k.gguf", "Q4_K")
    ref = compute_logits_on_rank(load(path), IDS[:4])
    got = compute_logits_on_rank(load(path, dtype="bfloat16"), IDS[:4]).float()
    assert ((got - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_engine_core_greedy_decode_from_blocks(dtype, kquant_llamas, tmp_path):
    """The whole engine (paged KV cache, decode steps, greedy sampling) on a Q4_K_M-style
    file: the same tokens as transformers' greedy decoding on the dequantised weights
    (float32: exact products; float16: int8 activations, which move this tiny random
    model's logits by up to about 0.1, so the prompt is one whose every greedy step wins
    by more than twice that, checked first: IDS's margins are 0.05)."""
    from transformers import AutoModelForCausalLM

    from config import SamplingParams
    from engine.core import EngineCore

    prompt = torch.tensor([183, 247, 69, 27, 113, 118, 236, 174, 191, 83])
    path = write_gguf(kquant_llamas["untied"], tmp_path / "mixed.gguf", "Q4_K_M", tensor_types=MIXED)
    oracle = dequantised_checkpoint(kquant_llamas["untied"], "Q4_K_M", tmp_path, MIXED)
    hf = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    with torch.no_grad():
        greedy = hf.generate(prompt[None], max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    expected = greedy.sequences[0, prompt.numel():].tolist()
    margins = [float(top[0] - top[1]) for top in (step[0].topk(2).values for step in greedy.logits)]
    assert min(margins) > 0.25, margins
    core = EngineCore(model=str(path), load_format="gguf", device="cpu", dtype=dtype, kv_cache_memory_bytes=1 << 22,
                      max_model_len=64, use_tqdm_on_load=False)
    try:
        (out,) = core.generate(prompt.tolist(), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        core.shutdown()
    assert out.token_ids == expected


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
def test_cuda_triton_kernel_matches_the_cpu(qtype):
    """On CUDA the products go through the Triton GEMM that reads the blocks (compiled
    here; tests/test_gguf_triton.py checks it under the interpreter), and the lookups
    and the torch fallback dequantise on the device."""
    assert gguf_kernels._triton_gemm() is not None
    data = (torch.randn(70, 512, generator=torch.Generator().manual_seed(7)) * 0.3).numpy()
    blocks = torch.from_numpy(quantize_blocks(data, qtype))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), Q[qtype]))
    assert torch.equal(dequantize(qtype, blocks.cuda(), 512).cpu(), expected)
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, 512)
        out = torch.empty(tokens, 70, device="cuda")
        gguf_kernels.gguf_linear(qtype, blocks.cuda(), 512, x.cuda(), out)
        torch.testing.assert_close(out.cpu(), F.linear(x, expected), atol=1e-4, rtol=1e-4)
        half = torch.empty(tokens, 70, dtype=torch.bfloat16, device="cuda")
        gguf_kernels.gguf_linear(qtype, blocks.cuda(), 512, x.cuda().bfloat16(), half)
        torch.testing.assert_close(half.float().cpu(), F.linear(x.bfloat16().float(), expected), atol=0.1, rtol=0.02)
    rows = gguf_kernels.gguf_dequantize_rows(qtype, blocks.cuda(), 512, torch.tensor([3, 0], device="cuda"))
    assert torch.equal(rows.cpu(), expected[[3, 0]])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_core_greedy_decode_from_blocks_on_cuda(kquant_llamas, tmp_path):
    """The engine on CUDA (Triton GGUF GEMMs, Triton attention, CUDA graphs) on the
    Q4_K_M-style file in float32: transformers' greedy tokens on the dequantised weights."""
    from transformers import AutoModelForCausalLM

    from config import SamplingParams
    from engine.core import EngineCore

    path = write_gguf(kquant_llamas["untied"], tmp_path / "mixed.gguf", "Q4_K_M", tensor_types=MIXED)
    oracle = dequantised_checkpoint(kquant_llamas["untied"], "Q4_K_M", tmp_path, MIXED)
    hf = AutoModelForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(IDS[None], max_new_tokens=6, do_sample=False)[0, IDS.numel():].tolist()
    core = EngineCore(model=str(path), load_format="gguf", device="cuda", dtype="float32",
                      kv_cache_memory_bytes=1 << 22, max_model_len=64, use_tqdm_on_load=False)
    try:
        (out,) = core.generate(IDS.tolist(), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        core.shutdown()
    assert out.token_ids == expected
