"""The CUDA GEMM of fp8 weight layers (models/layers/quantization/kernels/fp8_triton.py),
run here under Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1
where there is no GPU); on a GPU machine `pytest -m cuda` runs it compiled, through
`fp8_linear` (below) and the checkpoint layers (tests/test_quant_fp8_checkpoints.py).

The reference is a float64 product with dequant(weight) = q * scale per block:
- every e4m3fn byte decodes to torch's value (NaN bytes to NaN);
- float32 activations: IEEE products, within float32 rounding of sum |x||w|;
- float16: each weight value rounded once to float16, then an exact product;
- bfloat16: each weight value rounded once to bfloat16 (to nearest even on a GPU; the
  interpreter truncates, so the bound allows 2^-7 of each |x||w|);
16-bit outputs are rounded once more, to their dtype. Shapes: 128x128 blocks with
partial blocks at both edges, per-channel scales, blocks of another width.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_quant_fp8_checkpoints import dequantize_fp8_blocks, quantize_fp8_blocks

fp8_triton = pytest.importorskip("models.layers.quantization.kernels.fp8_triton")
FP8 = torch.float8_e4m3fn


def check_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                  out_dtype: torch.dtype) -> None:
    weight = dequantize_fp8_blocks(q, scale.float(), *block).double()
    n = q.shape[0]
    out = torch.full((x.shape[0], n + 3), float("nan"), dtype=out_dtype)
    fp8_triton.fp8_matmul_triton(x, q, scale, *block, out[:, 1:1 + n])
    assert out[:, :1].isnan().all() and out[:, 1 + n:].isnan().all()
    got = out[:, 1:1 + n].double()
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


def test_every_e4m3fn_byte_decodes_to_torchs_value():
    values = torch.arange(256, dtype=torch.uint8)
    finite = values[(values != 0x7F) & (values != 0xFF)]  # NaN times 0 would spoil a whole output
    q = finite.view(FP8).reshape(2, 127)
    out = torch.empty(127, 2)
    fp8_triton.fp8_matmul_triton(torch.eye(127), q, torch.ones(1, 1), 2, 127, out)
    assert torch.equal(out, q.float().t())
    nan = torch.tensor([[0x7F, 0x38], [0xFF, 0x38], [0x38, 0x38]], dtype=torch.uint8).view(FP8)  # 0x38: 1.0
    out = torch.empty(1, 3)
    fp8_triton.fp8_matmul_triton(torch.ones(1, 2), nan, torch.ones(1, 1), 3, 2, out)
    assert out[0, :2].isnan().all() and out[0, 2].item() == 2.0


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((70, 33), (1, 33)), ((130, 96), (64, 32))],
                         ids=["blocks", "channel", "narrow"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 17])  # 17: a whole 16-token tile and a partial one
def test_product_matches_float64(shape, block, dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    q, scale = quantize_fp8_blocks(torch.randn(*shape, generator=gen), *block)
    x = torch.randn(tokens, shape[1], generator=gen).to(dtype)
    check_product(x, q, scale, block, dtype)


def test_16bit_scales_strided_activations_and_float32_output():
    gen = torch.Generator().manual_seed(9)
    q, scale = quantize_fp8_blocks(torch.randn(64, 80, generator=gen), 32, 32)
    wide = torch.randn(3, 160, generator=gen).bfloat16()
    check_product(wide[:, ::2], q, scale.bfloat16(), (32, 32), torch.float32)


def test_bad_shapes_are_refused():
    q, scale = quantize_fp8_blocks(torch.randn(64, 80), 32, 32)
    x = torch.randn(2, 80)
    with pytest.raises(ValueError, match=r"scale \(2, 2\) for blocks of 32x32"):  # 80 inputs: 3 blocks
        fp8_triton.fp8_matmul_triton(x, q, scale[:, :2], 32, 32, torch.empty(2, 64))
    with pytest.raises(ValueError, match="do not fit"):
        fp8_triton.fp8_matmul_triton(x, q, scale, 32, 32, torch.empty(2, 65))
    with pytest.raises(ValueError, match="torch.float32"):
        fp8_triton.fp8_matmul_triton(x, q.float(), scale, 32, 32, torch.empty(2, 64))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block", [(128, 128), (1, 384)], ids=["blocks", "channel"])
def test_fp8_linear_on_cuda_takes_the_triton_gemm(block):
    """`fp8_linear` on CUDA (compiled Triton): the CPU's float64 reference, with bias."""
    from models.layers.quantization import fp8_kernels

    assert fp8_kernels._triton_gemm() is not None
    gen = torch.Generator().manual_seed(4)
    q, scale = quantize_fp8_blocks(torch.randn(300, 384, generator=gen), *block)
    weight = dequantize_fp8_blocks(q, scale, *block)
    bias = torch.randn(300, generator=gen)
    for tokens in (1, 40):
        x = torch.randn(tokens, 384, generator=gen)
        got = fp8_kernels.fp8_linear(x.cuda(), q.cuda(), scale.cuda(), *block, bias.cuda()).cpu()
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
        got16 = fp8_kernels.fp8_linear(x.cuda().bfloat16(), q.cuda(), scale.cuda(), *block).float().cpu()
        torch.testing.assert_close(got16, F.linear(x.bfloat16().float(), weight), atol=0.1, rtol=0.02)
