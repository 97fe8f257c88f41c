"""GGUF products for 8 to 64 tokens of 16-bit activations: dequantised bfloat16 tiles
(`gguf_kernels.gguf_gemm_bf16_shards`, a concurrent decode's batch sizes).

Q8_0 rows below 16 tokens take them; every type takes them, and the tiled prefill GEMM,
where the build has no int8 tiles (tests/test_gguf_int8_tiles.py), which every test here
switches off (`no_int8_tiles`) so that each type's bf16 tiles are what it checks.

Each 4-row tile is dequantised exactly (as gguf-py does), rounded once to bfloat16 and
multiplied by the bfloat16 activations with float32 sums: the result is the product of
the activations with the bf16-rounded weights up to float32 accumulation, so within
2^-8 of |x| . |w| of the exact product, for every block type, tile remainders (rows
not a multiple of 4, tokens not a multiple of 4) and float16 activations (rounded to
bfloat16 first). Fewer tokens take the int8 path and more the tiled prefill GEMM.
"""

from __future__ import annotations

import pytest
import torch

from models.layers.quantization import gguf_kernels
from models.layers.quantization.gguf_dequant import QUANTIZED_TYPES, dequantize
from tests.gguf_kquants import quantize as quantize_blocks

kernel = gguf_kernels.load()


def _blocks(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.from_numpy(quantize_blocks((torch.randn(rows, k, generator=g) * 0.3).numpy(), qtype))


pytestmark = pytest.mark.skipif(kernel is None or not kernel.has_bf16, reason="no AVX-512 BF16 in this CPU or build")


@pytest.fixture(autouse=True)
def no_int8_tiles(monkeypatch):
    """The kernels as a build without the int8 tiles routes them (AVX-512 BF16, no VNNI)."""
    if kernel is not None:
        monkeypatch.setattr(kernel, "int8_tile_min_tokens", {})  # has_int8_tiles and int8_tile_types follow


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("tokens", [8, 9, 17, gguf_kernels.BF16_TILE_MAX_TOKENS])
def test_bf16_tiles_multiply_the_bf16_rounded_weights(qtype, tokens):
    rows, k = 30, 512 + (32 if qtype in ("Q4_0", "Q8_0") else 0)  # 30: a last tile of 2 rows
    blocks = _blocks(qtype, rows, k, tokens)
    weight = dequantize(qtype, blocks, k).double()
    x = (torch.randn(tokens, k, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    out = torch.full((tokens, rows), float("nan"))
    gguf_kernels.gguf_linear(qtype, blocks, k, x, out)
    magnitude = x.double().abs() @ weight.abs().t()
    assert ((out.double() - x.double() @ weight.t()).abs() <= 2.0 ** -8 * magnitude + 1e-6).all()
    rounded = weight.float().bfloat16().double()  # what the tiles hold
    assert ((out.double() - x.double() @ rounded.t()).abs() <= 1e-5 * magnitude + 1e-6).all()


def test_float16_activations_are_rounded_to_bfloat16_first():
    k = 256
    blocks = _blocks("Q4_K", 12, k, 4)
    x = torch.randn(10, k, generator=torch.Generator().manual_seed(5)).half()
    got, expected = torch.empty(10, 12), torch.empty(10, 12)
    gguf_kernels.gguf_linear("Q4_K", blocks, k, x, got)
    gguf_kernels.gguf_linear("Q4_K", blocks, k, x.bfloat16(), expected)
    assert torch.equal(got, expected)


def test_fewer_tokens_take_the_int8_path():
    k = 256
    blocks = _blocks("Q6_K", 16, k, 6)
    few = torch.randn(gguf_kernels.BF16_TILE_MIN_TOKENS - 1, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    got, int8 = torch.empty(few.shape[0], 16), torch.empty(few.shape[0], 16)
    gguf_kernels.gguf_linear("Q6_K", blocks, k, few, got)
    assert kernel.gemm("Q6_K", blocks, k, few.float(), int8, int8_activations=True)
    assert torch.equal(got, int8)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
def test_more_tokens_take_the_tiled_gemm_on_tiles_dequantised_to_bf16(qtype, monkeypatch):
    """Past BF16_TILE_MAX_TOKENS, torch's GEMM on row tiles (two here) dequantised straight
    to bf16: exactly the product with gguf-py's values rounded to bf16."""
    monkeypatch.setattr(gguf_kernels, "TILE_ROWS", 12)
    k = 256 + (32 if qtype in ("Q4_0", "Q8_0") else 0)
    blocks = _blocks(qtype, 20, k, 9)
    weight = dequantize(qtype, blocks, k)
    tile = torch.empty(20, k, dtype=torch.bfloat16)
    assert kernel.dequantize_rows_bf16(qtype, blocks, k, tile)
    assert torch.equal(tile, weight.to(torch.bfloat16))
    many = torch.randn(gguf_kernels.BF16_TILE_MAX_TOKENS + 1, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    got = torch.empty(many.shape[0], 20)
    gguf_kernels.gguf_linear(qtype, blocks, k, many, got)
    expected = torch.cat([many @ weight[:12].to(torch.bfloat16).t(), many @ weight[12:].to(torch.bfloat16).t()], 1)
    assert torch.equal(got, expected.float())
