"""The CUDA GEMM of GGUF layers (models/layers/quantization/kernels/gguf_triton.py), run
here under Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 where
there is no GPU); on a GPU machine `pytest -m cuda` runs it compiled, through the
layers (tests/test_gguf_quantised.py).

The reference is `gguf_dequant.dequantize` (gguf-py's values bit for bit,
tests/test_gguf_quantised.py) and a float64 product:
- float32 activations: IEEE products, so within float32 rounding of sum |x||w|;
- float16: the weights rounded once to float16, then an exact product, the output
  rounded once to float16;
- bfloat16: the weights rounded once to bfloat16 (to nearest even on a GPU; the
  interpreter truncates, so the bound allows 2^-7 of each |x||w|), the output rounded
  once to bfloat16.
Blocks are both the test quantiser's (realistic values) and random bytes with finite
float16 scales (every bit pattern of the codes and the packed 6-bit scales).
"""

from __future__ import annotations

import pytest
import torch

from models.layers.quantization.gguf_dequant import QUANTIZED_TYPES, dequantize, row_bytes
from tests.gguf_kquants import quantize as quantize_blocks

triton_kernel = pytest.importorskip("models.layers.quantization.kernels.gguf_triton")

ROWS, K = 70, 768  # 70 rows: a whole 64-row tile and a partial one; 768: three K-quant super-blocks
# Byte offsets of each block's float16 fields (d; dmin).
F16_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def quantised_blocks(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.from_numpy(quantize_blocks((torch.randn(rows, k, generator=g) * 0.3).numpy(), qtype))


def random_blocks(qtype: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """Random bytes, each block's float16 scales set to finite values of either sign."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, row_bytes(qtype, k)), generator=g, dtype=torch.uint8)
    fmt_bytes = blocks.shape[1] // (k // (32 if qtype in ("Q4_0", "Q8_0") else 256))
    per_block = blocks.view(-1, fmt_bytes)
    for offset in F16_FIELDS[qtype]:
        scales = (torch.randn(per_block.shape[0], generator=g) * 0.01).half()
        per_block[:, offset:offset + 2] = scales.view(torch.uint8).view(-1, 2)
    return blocks


def run(qtype: str, blocks: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel's product into a shard's columns of a wider output, checking that the
    columns around it are untouched."""
    m, rows = x.shape[0], blocks.shape[0]
    out = torch.full((m, rows + 5), float("nan"), dtype=out_dtype)
    triton_kernel.gguf_matmul_triton(qtype, blocks, x.shape[1], x, out[:, 2:2 + rows])
    assert out[:, :2].isnan().all() and out[:, 2 + rows:].isnan().all()
    return out[:, 2:2 + rows]


def check_product(qtype: str, blocks: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> None:
    weight = dequantize(qtype, blocks, x.shape[1]).double()
    got = run(qtype, blocks, x, out_dtype).double()
    xd = x.double()
    magnitude = xd.abs() @ weight.abs().t()
    if x.dtype == torch.float32:
        expected, bound = xd @ weight.t(), 2e-6 * magnitude + 1e-6
    else:
        expected = xd @ weight.to(x.dtype).double().t()
        bound = (2.0 ** -7 * magnitude if x.dtype == torch.bfloat16 else 1e-6 * magnitude) + 1e-6
    if out_dtype != torch.float32:
        bound = bound + expected.abs() * torch.finfo(out_dtype).eps / 2 * 1.01
    assert ((got - expected).abs() <= bound).all(), (got - expected).abs().max()


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 17])  # 17: a whole 16-token tile and a partial one
def test_product_of_quantised_blocks(qtype, dtype, tokens):
    blocks = quantised_blocks(qtype, ROWS, K, tokens)
    x = (torch.randn(tokens, K, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    check_product(qtype, blocks, x, dtype)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
def test_every_bit_pattern_of_random_blocks(qtype):
    blocks = random_blocks(qtype, ROWS, K, 11)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(6))
    check_product(qtype, blocks, x, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_activations_into_a_float32_output(dtype):
    blocks = quantised_blocks("Q4_K", ROWS, K, 2)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(7)).to(dtype)
    check_product("Q4_K", blocks, x, torch.float32)


def test_strided_activations_and_no_tokens():
    blocks = quantised_blocks("Q6_K", 8, 256, 3)
    wide = torch.randn(3, 2 * 256, generator=torch.Generator().manual_seed(8))
    check_product("Q6_K", blocks, wide[:, ::2], torch.float32)
    out = torch.empty(0, 8)
    triton_kernel.gguf_matmul_triton("Q6_K", blocks, 256, torch.empty(0, 256), out)


def test_bad_arguments_are_refused():
    blocks = quantised_blocks("Q8_0", 8, 256, 4)
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="F16 has no Triton kernel"):
        triton_kernel.gguf_matmul_triton("F16", blocks, 256, x, torch.empty(2, 8))
    with pytest.raises(ValueError, match=r"Q4_0 rows of 256 values are \[rows, 144\]"):
        triton_kernel.gguf_matmul_triton("Q4_0", blocks, 256, x, torch.empty(2, 8))
    with pytest.raises(ValueError, match="do not fit a"):
        triton_kernel.gguf_matmul_triton("Q8_0", blocks, 256, x, torch.empty(2, 9))
    with pytest.raises(ValueError, match="not a whole number of Q8_0 blocks"):
        triton_kernel.gguf_matmul_triton("Q8_0", blocks, 250, x[:, :250], torch.empty(2, 8))
