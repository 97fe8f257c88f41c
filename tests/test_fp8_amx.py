"""fp8 (e4m3) weights times bfloat16 activations on AMX tiles (fp8_amx.c).

On CPUs with AMX `fp8_linear` sends bfloat16 batches of `AMX_MIN_ROWS` rows and more
there: each 32-row block of the weight converted once into its exact bfloat16 values,
each k-block's float32 sums times its scale. Checked here: every e4m3 byte converts to
its value (subnormals, both zeros, NaN); outputs against float64 to their one rounding
for 128x128 blocks with tails, k-blocks of 32, one scale per row and per tensor, every
token count around the tiles' 16 and 32 and a partial last 32-row block; an input width
or k-block the tiles cannot take declined (None; fp8_linear then takes the other paths);
the thread count changing nothing; which batches take it. Skipped where the CPU (or its
compiler) has no AMX.
"""

from __future__ import annotations

import pytest
import torch

from models.layers.quantization import fp8_kernels
from models.layers.quantization.fp8_kernels import AMX_MIN_ROWS, fp8_linear
from tests.test_fp8_bf16 import _case
from tests.test_quant_fp8_checkpoints import FP8, dequantize_fp8_blocks

_KERNEL = fp8_kernels.load()
pytestmark = pytest.mark.skipif(_KERNEL is None or not _KERNEL.has_amx, reason="needs a CPU with AMX tiles")


@pytest.fixture
def kernel() -> fp8_kernels.Fp8DequantKernel:
    return fp8_kernels.load()  # the library fp8_linear uses now (other tests clear `load`'s cache)


@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-5])
def test_every_byte_converts_to_its_value(kernel, scale: float) -> None:
    """Weight rows holding every finite e4m3 byte against one-hot tokens: each output is
    one weight's value times the scale, rounded once to bfloat16; a row holding a NaN
    byte (0x7f, 0xff) gives NaN."""
    every = torch.arange(256, dtype=torch.uint8)
    finite = torch.cat([every[(every & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.uint8)])  # 254 bytes, two zeros
    weight = torch.stack([finite.roll(37 * i) for i in range(5)] + [every]).view(FP8).contiguous()  # [6, 256]
    scales = torch.full((6, 1), scale)
    expected = (weight.to(torch.float32) * scale).to(torch.bfloat16)
    x = torch.eye(256, dtype=torch.bfloat16)  # token t picks input t
    out = kernel.amx_linear(x, weight, scales, 1, 256)
    assert out is not None and out.dtype == torch.bfloat16
    assert torch.equal(out[:, :5], expected[:5].t())
    assert out[:, 5].isnan().all()


@pytest.mark.parametrize("n,k,block", [(301, 640, (128, 128)), (70, 96, (1, 96)), (64, 256, (64, 256)),
                                       (100, 320, (32, 32)), (33, 160, (128, 128))],
                         ids=["blocks-tails", "channel", "tensor", "blocks-of-32", "blocks-partial-k"])
@pytest.mark.parametrize("rows", [AMX_MIN_ROWS, 16, 17, 32, 33, 70])
def test_exact_products_match_float64(kernel, n: int, k: int, block: tuple[int, int], rows: int) -> None:
    """Float32 sums of exact products per k-block, times the block's scale: one rounding."""
    q, scale = _case(n, k, block, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    out = kernel.amx_linear(x, q, scale, *block)
    ref = x.double() @ dequantize_fp8_blocks(q, scale, *block).double().t()
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=2 ** -8)
    assert torch.equal(fp8_linear(x, q, scale, *block), out)  # what the layers call from AMX_MIN_ROWS rows


def test_widths_and_blocks_the_tiles_cannot_take_are_declined(kernel) -> None:
    x = torch.randn(8, 48).to(torch.bfloat16)
    q, scale = _case(40, 48, (1, 48))
    assert kernel.amx_linear(x, q, scale, 1, 48) is None  # 48 inputs: not a multiple of 32
    x = torch.randn(8, 96).to(torch.bfloat16)
    q, scale = _case(40, 96, (16, 48))
    assert kernel.amx_linear(x, q, scale, 16, 48) is None  # k-blocks of 48
    ref = x.double() @ dequantize_fp8_blocks(q, scale, 16, 48).double().t()
    torch.testing.assert_close(fp8_linear(x, q, scale, 16, 48).double(), ref, atol=1e-2 * ref.abs().max().item(),
                               rtol=2 ** -7)  # the other paths take it


def test_the_thread_count_changes_nothing(kernel) -> None:
    q, scale = _case(517, 384, (128, 128))
    x = torch.randn(23, 384).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.amx_linear(x, q, scale, 128, 128)
        torch.set_num_threads(max(2, threads))
        many = kernel.amx_linear(x, q, scale, 128, 128)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_fewer_rows_and_float32_batches_take_the_other_paths(kernel, monkeypatch) -> None:
    q, scale = _case(96, 256, (128, 128))
    calls = []
    monkeypatch.setattr(type(kernel), "amx_linear", lambda self, *a: calls.append(a[0].shape[0]))
    for rows, dtype in ((AMX_MIN_ROWS - 1, torch.bfloat16), (AMX_MIN_ROWS, torch.float32),
                        (AMX_MIN_ROWS, torch.bfloat16)):
        fp8_linear(torch.randn(rows, 256).to(dtype), q, scale, 128, 128)
    assert calls == [AMX_MIN_ROWS]  # (its None sends that batch on to the other paths)
