"""The int8 tiles (`gguf_kernels.gguf_gemm_int8_tiles`: gguf_vnni_tiles.c, or
gguf_avx2_tiles.c on AVX2 builds): K-quant, Q8_0 and (VNNI) Q4_0 rows times 8 or more
tokens of 16-bit activations (Q8_0 from 16 where the build has bf16 tiles), a concurrent
decode's batches and every prefill.

The activations are quantised per token and per 32 values to int8 (dx = max|x| / 127,
rounded to nearest even); the result is the product of the weights with those rounded
activations up to float32 rounding, so within sum |w| * dx / 2 of the product with the
activations themselves. Checked, through the tiles themselves, for every type the
build's tiles take, float16 and bfloat16 activations, float32 and 16-bit outputs, row
counts that leave a partial 16-row tile, token counts around the 8-token register block,
a shard's columns of a wider output; and from how many tokens the layers take them.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from models.layers.quantization import gguf_kernels
from models.layers.quantization.gguf_dequant import dequantize
from tests.gguf_kquants import quantize as quantize_blocks

kernel = gguf_kernels.load()
pytestmark = pytest.mark.skipif(kernel is None or not kernel.has_int8_tiles,
                                reason="no AVX-512 VNNI or AVX2 in this CPU or build (the int8 tiles)")

KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]
#: Every type the build's tiles take: the K-quants and Q8_0, and Q4_0 on VNNI.
TILE_TYPES = sorted(kernel.int8_tile_types) if kernel is not None else KQUANTS


def _tiles(qtype: str, blocks: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = x times `blocks` through the int8 tiles, at any token count."""
    assert kernel.gemm_shards_int8_tiles(gguf_kernels.ShardPlan([(qtype, blocks)]), k, x, out)


def _blocks(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.from_numpy(quantize_blocks((torch.randn(rows, k, generator=g) * 0.3).numpy(), qtype))


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantises it, back in float64: round(x * (127 / amax)) * (amax /
    127) per 32 values, in IEEE float32 arithmetic (numpy's; torch's vectorised division
    is not always correctly rounded)."""
    tokens, k = x.shape
    xf = x.float().reshape(tokens, -1, 32).numpy()
    amax = np.abs(xf).max(-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(xf * inv).astype(np.float64) * (amax / np.float32(127)).astype(np.float64)
    return torch.from_numpy(q).reshape(tokens, k)


@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 16, 17, 100])
def test_product_with_the_activations_rounded_per_32(qtype, dtype, tokens):
    rows, k = 37, 768  # 37: two whole 16-row tiles and a tile of 5
    blocks = _blocks(qtype, rows, k, tokens)
    weight = dequantize(qtype, blocks, k).double()
    x = (torch.randn(tokens, k, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    x[0, :32] = 0  # an all-zero 32 (dx 0)
    x[-1, 40] = 300  # an outlier widens only its own 32's step
    out = torch.full((tokens, rows + 5), float("nan"))
    _tiles(qtype, blocks, k, x, out[:, 2:2 + rows])
    assert out[:, :2].isnan().all() and out[:, 2 + rows:].isnan().all()
    got = out[:, 2:2 + rows].double()
    rounded = _rounded(x)
    magnitude = rounded.abs() @ weight.abs().t()
    assert ((got - rounded @ weight.t()).abs() <= 1e-6 * magnitude + 1e-6).all()
    groups = x.double().reshape(tokens, -1, 32)
    dx = groups.abs().amax(-1) / 127
    bound = (weight.abs().reshape(1, rows, -1, 32).sum(-1) * dx.reshape(tokens, 1, -1) / 2).sum(-1)
    assert ((got - x.double() @ weight.t()).abs() <= bound + 1e-5).all()


@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_many_tokens_and_super_blocks_past_the_kernels_blocks(qtype):
    """More tokens than one pass over a tile takes (the AVX2 tiles' 128) and a
    super-block count that leaves a partial group of 4 (k = 1280): every token and
    output still the product with the rounded activations."""
    rows, k, tokens = 21, 1280, 300
    blocks = _blocks(qtype, rows, k, 13)
    weight = dequantize(qtype, blocks, k).double()
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(14)).bfloat16()
    out = torch.full((tokens, rows), float("nan"))
    _tiles(qtype, blocks, k, x, out)
    rounded = _rounded(x)
    magnitude = rounded.abs() @ weight.abs().t()
    assert ((out.double() - rounded @ weight.t()).abs() <= 1e-6 * magnitude + 1e-6).all()


@pytest.mark.parametrize("qtype", TILE_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_output_is_the_float32_one_rounded_once(qtype, dtype):
    k = 512
    blocks = _blocks(qtype, 20, k, 1)
    x = (torch.randn(24, k, generator=torch.Generator().manual_seed(4)) * 2).to(dtype)
    exact, rounded = torch.empty(24, 20), torch.empty(24, 20, dtype=dtype)
    _tiles(qtype, blocks, k, x, exact)
    _tiles(qtype, blocks, k, x, rounded)
    assert torch.equal(rounded, exact.to(dtype))


# Byte ranges of each K-quant block: (its codes, set to all ones: every value the type's
# largest), and its float16 fields.
CODE_BYTES = {"Q4_K": [(16, 144)], "Q5_K": [(16, 176)], "Q6_K": [(0, 192)]}
F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("code_byte", [255, 0])
def test_largest_codes_times_largest_activations_do_not_overflow(qtype, code_byte):
    """Every code at its largest (15, 31, 63) or smallest (0; Q6_K's -32) against
    activations that all quantise to +-127: the integer sums the kernels keep (16-bit
    partial sums in the AVX2 tiles, whose Q6_K activations are unsigned, x + 128) at
    their largest, still the product with the rounded activations."""
    rows, k = 9, 512
    g = torch.Generator().manual_seed(12)
    blocks = torch.randint(0, 256, (rows, k // 256 * {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]),
                           generator=g, dtype=torch.uint8)
    per_block = blocks.view(-1, blocks.shape[1] // (k // 256))
    for start, end in CODE_BYTES[qtype]:
        per_block[:, start:end] = code_byte
    for offset in F16_FIELDS[qtype]:
        per_block[:, offset:offset + 2] = (torch.rand(per_block.shape[0], generator=g) * 0.01 + 0.001).half() \
            .view(torch.uint8).view(-1, 2)
    weight = dequantize(qtype, blocks, k).double()
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.full((8, k), 1.5).to(dtype)
        x[1] = -1.5
        out = torch.empty(8, rows)
        _tiles(qtype, blocks, k, x, out)
        rounded = _rounded(x)
        magnitude = rounded.abs() @ weight.abs().t()
        assert ((out.double() - rounded @ weight.t()).abs() <= 1e-6 * magnitude + 1e-6).all(), qtype


@pytest.mark.parametrize(("qtype", "code_byte"), [("Q8_0", 0x80), ("Q8_0", 0x7F), ("Q4_0", 0xFF), ("Q4_0", 0x00)],
                         ids=["q8_0-minus128", "q8_0-127", "q4_0-7", "q4_0-minus8"])
def test_legacy_extreme_codes_times_largest_activations(qtype, code_byte):
    """Q8_0's extreme codes (-128, which llama.cpp's quantiser never writes but a file may
    hold, and 127) and Q4_0's (7 and -8) against activations that all quantise to +-127:
    still the product with the rounded activations (the AVX2 tiles' 32-bit sums per block;
    the VNNI tiles' codes read unsigned, 0 and 255, their offsets taken off in integers)."""
    if qtype not in kernel.int8_tile_types:
        pytest.skip(f"this build's tiles take no {qtype} (AVX2 builds: Q4_0 rows take the int8 rows)")
    rows, k = 9, 512
    blocks = _blocks(qtype, rows, k, 15)
    per_block = blocks.view(-1, {"Q8_0": 34, "Q4_0": 18}[qtype])
    per_block[:, 2:] = code_byte
    weight = dequantize(qtype, blocks, k).double()
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.full((8, k), 1.5).to(dtype)
        x[1] = -1.5
        out = torch.empty(8, rows)
        _tiles(qtype, blocks, k, x, out)
        rounded = _rounded(x)
        magnitude = rounded.abs() @ weight.abs().t()
        assert ((out.double() - rounded @ weight.t()).abs() <= 1e-6 * magnitude + 1e-6).all()


def test_a_q4_k_m_layer_in_one_call():
    """Q4_K and Q6_K shards (a Q4_K_M attention's q, k, v) in one call: each shard's
    columns as its own call gives them."""
    k = 512
    shards = [("Q4_K", _blocks("Q4_K", 32, k, 5)), ("Q4_K", _blocks("Q4_K", 16, k, 6)),
              ("Q6_K", _blocks("Q6_K", 16, k, 7))]
    plan = gguf_kernels.shard_plan(shards)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = torch.empty(12, 64, dtype=torch.bfloat16)
    assert kernel.gemm_shards_int8_tiles(plan, k, x, out)
    start = 0
    for qtype, blocks in shards:
        one = torch.empty(12, blocks.shape[0], dtype=torch.bfloat16)
        assert kernel.gemm_shards_int8_tiles(gguf_kernels.ShardPlan([(qtype, blocks)]), k, x, one)
        assert torch.equal(out[:, start:start + blocks.shape[0]], one)
        start += blocks.shape[0]


def test_where_the_tiles_are_taken():
    """From INT8_TILE_MIN_TOKENS tokens of 16-bit activations on, K-quant rows take the
    int8 tiles at every count (the prefill's too); fewer take the int8 rows (x per 256),
    float32 activations the exact float path. Q8_0 rows take them from 16 tokens where the
    build has bf16 tiles (which take 8-15), from 8 elsewhere; Q4_0 rows from 8 where the
    build's tiles take them (VNNI). The library says so (`int8_tile_min_tokens`), and the
    layers follow it."""
    assert all(kernel.int8_tile_min_tokens[q] == gguf_kernels.INT8_TILE_MIN_TOKENS for q in KQUANTS)
    assert kernel.int8_tile_min_tokens["Q8_0"] == (16 if kernel.has_bf16 else gguf_kernels.INT8_TILE_MIN_TOKENS)
    k = 512
    blocks = _blocks("Q4_K", 16, k, 9)
    g = torch.Generator().manual_seed(10)
    for tokens in (gguf_kernels.INT8_TILE_MIN_TOKENS, gguf_kernels.BF16_TILE_MAX_TOKENS + 1):
        x = torch.randn(tokens, k, generator=g).bfloat16()
        got, tiles = torch.empty(tokens, 16), torch.empty(tokens, 16)
        gguf_kernels.gguf_linear("Q4_K", blocks, k, x, got)
        _tiles("Q4_K", blocks, k, x, tiles)
        assert torch.equal(got, tiles)
    few = torch.randn(gguf_kernels.INT8_TILE_MIN_TOKENS - 1, k, generator=g).bfloat16()
    got, rows = torch.empty(few.shape[0], 16), torch.empty(few.shape[0], 16)
    gguf_kernels.gguf_linear("Q4_K", blocks, k, few, got)
    assert kernel.gemm("Q4_K", blocks, k, few.float(), rows, int8_activations=True)
    assert torch.equal(got, rows)
    exact = torch.randn(gguf_kernels.INT8_TILE_MIN_TOKENS, k, generator=g)
    got, floats = torch.empty(exact.shape[0], 16), torch.empty(exact.shape[0], 16)
    gguf_kernels.gguf_linear("Q4_K", blocks, k, exact, got)
    assert kernel.gemm("Q4_K", blocks, k, exact, floats)
    assert torch.equal(got, floats)
    for qtype in ("Q8_0", "Q4_0"):
        legacy = _blocks(qtype, 16, k, 11)
        for tokens in (8, 15, 16, 65):
            x = torch.randn(tokens, k, generator=g).bfloat16()
            got, other = torch.empty(tokens, 16), torch.empty(tokens, 16)
            gguf_kernels.gguf_linear(qtype, legacy, k, x, got)
            if kernel.int8_tiles_take(qtype, tokens):
                _tiles(qtype, legacy, k, x, other)
            elif tokens <= gguf_kernels.BF16_TILE_MAX_TOKENS and kernel.has_bf16:
                assert kernel.gemm_shards_bf16(gguf_kernels.ShardPlan([(qtype, legacy)]), k, x, other)
            else:
                continue  # the int8 rows (AVX2, up to 16 tokens) or the tiled GEMM: test_gguf_shards.py
            assert torch.equal(got, other), (qtype, tokens)
    assert kernel.int8_tiles_take("Q8_0", 16) and not kernel.int8_tiles_take("F16", 100)
    taken = re.escape(str(sorted(kernel.int8_tile_types)))
    floats = torch.randn(16, k).half().view(torch.uint8)
    with pytest.raises(ValueError, match=taken + r" rows .* not \['F16'\]"):
        kernel.gemm_shards_int8_tiles(gguf_kernels.ShardPlan([("F16", floats)]), k, x, torch.empty(x.shape[0], 16))
