"""fp8 (e4m3) weights times bfloat16 activations by bfloat16 dot products (fp8_bf16.c).

On AVX-512 BF16 CPUs `fp8_linear` sends bfloat16 batches of up to `BF16_MAX_ROWS` rows
there: exact (each k-block's float32 sums times its scale) with one scale per row, and
with blocks along the input up to `BF16_EXACT_MAX_ROWS`; above, each q * s rounded to
bfloat16 first, the values fp8_dequant_rows' tiles hold. Checked here: every e4m3 byte
converts to its exact value (subnormals, both zeros, NaN); the exact mode against
float64 to the output's rounding; the rounded mode bit for bit against the tiles it
replaces (the dense bf16 kernel on fp8_dequant_rows' values); tails of rows, inputs and
tokens; the thread count changing nothing; a k-block that is not a multiple of 32
declined (the GEMV and tiles then); which path each batch takes. Skipped where the CPU
has no AVX-512 BF16 (the library is then built without it: `has_bf16_linear` False,
which tests/test_kernel_targets.py's compiles cover).
"""

from __future__ import annotations

import pytest
import torch

from models.layers import cpu_bf16_gemm
from models.layers.quantization import fp8_kernels
from models.layers.quantization.fp8_kernels import BF16_EXACT_MAX_ROWS, BF16_MAX_ROWS, fp8_linear
from tests.test_quant_fp8_checkpoints import FP8, dequantize_fp8_blocks, quantize_fp8_blocks

_KERNEL = fp8_kernels.load()
pytestmark = pytest.mark.skipif(_KERNEL is None or not _KERNEL.has_bf16_linear or cpu_bf16_gemm.load() is None,
                                reason="needs a CPU with AVX-512 BF16")


@pytest.fixture
def kernel() -> fp8_kernels.Fp8DequantKernel:
    """The library fp8_linear uses now (other tests clear `load`'s cache)."""
    return fp8_kernels.load()


def _case(n: int, k: int, block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8_blocks(torch.randn(n, k, generator=gen), *block)


@pytest.mark.parametrize("tokens", [4, BF16_MAX_ROWS], ids=["in-the-tile", "through-the-panel"])
@pytest.mark.parametrize("round_weights", [False, True], ids=["exact", "rounded"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-5])
def test_every_byte_converts_to_its_value(kernel, round_weights: bool, scale: float, tokens: int) -> None:
    """Weight rows holding every finite e4m3 byte against one-hot tokens: each output is
    one weight's value times the scale, rounded once to bfloat16; a row holding a NaN
    byte (0x7f, 0xff) gives NaN. Up to 4 tokens the exact tile converts the bytes
    itself; more go through the panel."""
    every = torch.arange(256, dtype=torch.uint8)
    finite = torch.cat([every[(every & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.uint8)])  # 254 bytes, two zeros
    weight = torch.stack([finite.roll(37 * i) for i in range(5)] + [every]).view(FP8).contiguous()  # [6, 256]
    scales = torch.full((6, 1), scale)
    expected = (weight.to(torch.float32) * scale).to(torch.bfloat16)
    for first in range(0, 256, tokens):
        x = torch.zeros(tokens, 256, dtype=torch.bfloat16)
        x[torch.arange(tokens), first + torch.arange(tokens)] = 1
        out = kernel.bf16_linear(x, weight, scales, 1, 256, round_weights)
        assert out is not None and out.dtype == torch.bfloat16
        assert torch.equal(out[:, :5], expected[:5, first:first + tokens].t()), first
        assert out[:, 5].isnan().all()


@pytest.mark.parametrize("n,k,block", [(301, 600, (128, 96)), (70, 33, (1, 33)), (64, 256, (64, 256)),
                                       (130, 200, (128, 128))], ids=["blocks-tails", "channel-odd-k", "tensor",
                                                                     "blocks-partial"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
def test_exact_mode_matches_float64(kernel, n: int, k: int, block: tuple[int, int], rows: int) -> None:
    """The exact mode: float32 sums of exact products, one rounding (the output's)."""
    q, scale = _case(n, k, block, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    out = kernel.bf16_linear(x, q, scale, *block, False)
    ref = x.double() @ dequantize_fp8_blocks(q, scale, *block).double().t()
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=2 ** -8)


@pytest.mark.parametrize("n,k,block", [(301, 600, (128, 96)), (1000, 256, (128, 128)), (70, 33, (1, 33))],
                         ids=["blocks-tails", "blocks", "channel-odd-k"])
@pytest.mark.parametrize("rows", [2, 9, 31, 64])
def test_rounded_mode_is_the_tiles_bit_for_bit(kernel, n: int, k: int, block: tuple[int, int],
                                                rows: int) -> None:
    """The rounded mode holds q * s rounded to bfloat16, the values fp8_dequant_rows
    writes into the tiles, and sums them as the dense bf16 VDPBF16PS kernel does (on AMX
    CPUs the tiles of more rows go to the AMX product instead): the same bits."""
    q, scale = _case(n, k, block, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    tile = torch.empty(n, k, dtype=torch.bfloat16)
    kernel.dequant_rows(q, 0, n, scale, *block, tile)
    assert torch.equal(kernel.bf16_linear(x, q, scale, *block, True), cpu_bf16_gemm.load().linear(x, tile, None))


@pytest.mark.parametrize("round_weights", [False, True], ids=["exact", "rounded"])
def test_the_thread_count_changes_nothing(kernel, round_weights: bool) -> None:
    q, scale = _case(517, 384, (128, 128))
    x = torch.randn(23, 384).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.bf16_linear(x, q, scale, 128, 128, round_weights)
        torch.set_num_threads(max(2, threads))
        many = kernel.bf16_linear(x, q, scale, 128, 128, round_weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("rows", [12, 40])
def test_a_k_block_not_a_multiple_of_32_is_declined(kernel, monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """block_k 100 of 600 inputs: declined (None), and fp8_linear then takes the GEMV (up
    to GEMV_MAX_ROWS rows) or the tiles, with the same products."""
    q, scale = _case(200, 600, (128, 100))
    x = torch.randn(rows, 600).to(torch.bfloat16)
    assert kernel.bf16_linear(x, q, scale, 128, 100, False) is None
    gemv_rows: list[int] = []
    real = kernel.gemv
    monkeypatch.setattr(kernel, "gemv", lambda x32, *rest: gemv_rows.append(x32.shape[0]) or real(x32, *rest))
    ref = x.double() @ dequantize_fp8_blocks(q, scale, 128, 100).double().t()
    got = fp8_linear(x, q, scale, 128, 100)
    assert gemv_rows == ([rows] if rows <= fp8_kernels.GEMV_MAX_ROWS else [])
    assert got.dtype == torch.bfloat16 and ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_each_batch_takes_its_path(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 rows: exact up to BF16_EXACT_MAX_ROWS (blocks along the input) and at any
    count with one scale per row, rounded above, the tiles past BF16_MAX_ROWS; float32
    rows never come here (the float32 GEMV). Each result against float64. (Where the CPU
    has AMX, fp8_amx.c takes AMX_MIN_ROWS rows and more first: tests/test_fp8_amx.py.)"""
    monkeypatch.setattr(kernel, "has_amx", False)
    seen: list[tuple[int, bool]] = []
    real = kernel.bf16_linear

    def spy(x, weight, scale, block_n, block_k, round_weights):
        seen.append((x.shape[0], round_weights))
        return real(x, weight, scale, block_n, block_k, round_weights)

    monkeypatch.setattr(kernel, "bf16_linear", spy)
    for block, rows, expected in [((128, 128), BF16_EXACT_MAX_ROWS, [(BF16_EXACT_MAX_ROWS, False)]),
                                  ((128, 128), BF16_EXACT_MAX_ROWS + 1, [(BF16_EXACT_MAX_ROWS + 1, True)]),
                                  ((1, 256), BF16_MAX_ROWS, [(BF16_MAX_ROWS, False)]),
                                  ((128, 128), BF16_MAX_ROWS + 1, [])]:
        seen.clear()
        q, scale = _case(256, 256, block, rows)
        x = torch.randn(rows, 256)
        got = fp8_linear(x.to(torch.bfloat16), q, scale, *block)
        assert seen == expected, (block, rows, seen)
        ref = x.to(torch.bfloat16).double() @ dequantize_fp8_blocks(q, scale, *block).double().t()
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2
        seen.clear()
        fp8_linear(x, q, scale, *block)
        assert seen == []
