"""The WNA16 layout and its kernels (models/layers/quantization/kernels/), against a plain
dequantise-then-matmul reference:

- the layout holds exactly the codes, scales and zero points it was given (contiguous
  groups, act-order permutations, groups padded to whole 32-input blocks);
- the C GEMV (1-8 tokens) and the tiled dequantise + GEMM (more tokens), the AMX tiles
  (bfloat16 tokens from AMX_MIN_TOKENS on, where the CPU has them), the torch fallback,
  and the Triton kernel (under Triton's interpreter here) all give x W^T;
- float16 / bfloat16 / float32 scales (float16 subnormals included) read exactly;
- the formats' int32 packing matches AutoGPTQ's and AutoAWQ's documented bit order,
  and compressed-tensors' own unpacking when that library is installed;
- a fused layer whose sub-projections carry different g_idx is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.errors import WeightLoadError
from models.layers import cpu_sgemm
from models.layers.cpu_bf16_gemm import cpu_has_avx512_bf16
from models.layers.cpu_gemm import lacks_native_gemm
from models.layers.quantization.kernels import wna16_cpu
from models.layers.quantization.kernels.wna16_apply import apply_wna16, dequantize_wna16
from models.layers.quantization.kernels.wna16_layout import (
    compact_scales,
    get_wna16_layout,
    set_wna16_layout,
)
from models.layers.quantization.wna16 import (
    AWQ_PACK_ORDER,
    fused_replica_loader,
    unpack_int32,
)
from tests.quant_checkpoints import pack_int32


def _layer(n: int, k: int, bits: int, input_groups: torch.Tensor, scale_dtype: torch.dtype = torch.float16,
           seed: int = 0, scale_factor: float = 1.0) -> tuple[nn.Module, torch.Tensor]:
    """A module holding a random WNA16 weight, and that weight dequantised [n, k] float32."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)
    groups = int(input_groups.max()) + 1
    scales = ((torch.rand(n, groups, generator=gen) * 0.02 + 1e-3) * scale_factor).to(scale_dtype).float()
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen)
    weight = (codes - zeros[:, input_groups]).float() * scales[:, input_groups]
    layer = nn.Module()
    set_wna16_layout(layer, bits, lambda a, b: codes[a:b], scales, zeros, input_groups, [])
    return layer, weight


GROUPINGS = {
    "contiguous_g64": lambda k: torch.arange(k) // 64,
    "channel": lambda k: torch.zeros(k, dtype=torch.long),
    "act_order_g32": lambda k: torch.randperm(k, generator=torch.Generator().manual_seed(1)) // 32,
    # a row-parallel act-order shard: any groups, any sizes -> padded blocks
    "ragged": lambda k: torch.randint(3, 13, (k,), generator=torch.Generator().manual_seed(2)),
}


@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("bits", [4, 8])
def test_layout_holds_the_weight_and_cpu_paths_compute_x_wt(bits: int, grouping: str) -> None:
    k = 256
    layer, weight = _layer(72, k, bits, GROUPINGS[grouping](k))
    layout = get_wna16_layout(layer)
    assert torch.equal(dequantize_wna16(layout), weight)
    assert layout.qweight.dtype == torch.uint8 and layout.qweight.shape[1] == layout.padded_in_features * bits // 8
    if grouping == "contiguous_g64":
        assert layout.input_perm is None and layout.padded_in_features == k
    if grouping == "ragged":
        assert layout.padded_in_features > k  # each group padded to whole blocks
    kernel = wna16_cpu.load()
    assert kernel is not None, "the C kernel should build on this machine"
    for m in (1, 3, 4, 5, 8, 9, 70):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        expected = x @ weight.t()
        torch.testing.assert_close(apply_wna16(layer, x, None), expected, atol=2e-5, rtol=1e-5)
        xp = x if layout.input_perm is None else torch.nn.functional.pad(x, (0, 1)).index_select(1, layout.input_perm)
        torch.testing.assert_close(wna16_cpu.wna16_matmul(xp.contiguous(), layout, None), expected, atol=2e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("grouping", ["contiguous_g64", "ragged"])
@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_at_every_token_count_and_row_remainder(bits: int, grouping: str) -> None:
    """The C GEMV for 1-32 tokens (every tile shape of the AVX-512 and AVX2 builds, and
    their chunks of 4 tokens) over 71 rows (remainders of 2 and 4), against the float64
    product of the dequantised weight: float32 sums of exact weights (AVX2: of exact
    q - z, scaled per block)."""
    kernel = wna16_cpu.load()
    assert kernel is not None, "the C kernel should build on this machine"
    k = 320
    layer, weight = _layer(71, k, bits, GROUPINGS[grouping](k), seed=bits)
    layout = get_wna16_layout(layer)
    for m in range(1, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
        xp = x if layout.input_perm is None else torch.nn.functional.pad(x, (0, 1)).index_select(1, layout.input_perm)
        expected = (x.double() @ weight.double().t()).float()
        got = kernel.gemv(xp.contiguous(), layout)
        torch.testing.assert_close(got, expected, atol=1e-5 * (1 << bits), rtol=1e-5, msg=f"{m} tokens")


def test_bias_batch_dims_and_bfloat16_activations() -> None:
    layer, weight = _layer(64, 128, 4, torch.arange(128) // 32)
    x = torch.randn(2, 3, 128)
    bias = torch.randn(64)
    torch.testing.assert_close(apply_wna16(layer, x, bias), x @ weight.t() + bias, atol=2e-5, rtol=1e-5)
    y = apply_wna16(layer, x.bfloat16(), bias.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 64)
    torch.testing.assert_close(y.float(), x.bfloat16().float() @ weight.t() + bias.bfloat16().float(), atol=3e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grouping", list(GROUPINGS))
def test_bfloat16_tokens_through_bfloat16_dot_products(grouping: str, scale_dtype: torch.dtype) -> None:
    """A bfloat16 model's decode (1-6 tokens): int4 codes go straight into bfloat16 dot
    products (AVX512-BF16); each product is exact, so only float32 sums differ."""
    kernel = wna16_cpu.load()
    if kernel is None or not kernel.has_bf16_gemv:
        pytest.skip("this CPU has no AVX512-BF16")
    k = 512
    # bfloat16 scales below float16's range keep the bfloat16 buffer
    factor = 2.0 ** -20 if scale_dtype == torch.bfloat16 else 1.0
    layer, weight = _layer(72, k, 4, GROUPINGS[grouping](k), scale_dtype=scale_dtype, seed=9, scale_factor=factor)
    layout = get_wna16_layout(layer)
    assert layout.scales.dtype == scale_dtype
    for m in (1, 2, 3, 5, 6):
        x = torch.randn(m, k).bfloat16()
        xp = x if layout.input_perm is None else torch.nn.functional.pad(x, (0, 1)).index_select(1, layout.input_perm)
        expected = x.float() @ weight.t()
        got = kernel.gemv_bf16(xp.contiguous(), layout)
        assert got is not None
        torch.testing.assert_close(got, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
        torch.testing.assert_close(apply_wna16(layer, x, None).float(), expected,
                                   atol=0.02 * expected.abs().max().item(), rtol=0.01)


@pytest.mark.parametrize("switch", ["1", "0"], ids=["kernel-on", "TP_CPU_BF16_GEMM=0"])
@pytest.mark.parametrize("bits", [4, 8])
def test_bfloat16_batches_use_weight_tiles_rounded_to_bfloat16(bits: int, switch: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 tiles (the weights rounded to bfloat16, as a bfloat16 model's) wherever a
    bfloat16 weight has a fast GEMM: torch's with AVX512-BF16, our AVX2 kernel's
    (`cpu_sgemm.linear_half`) where torch's is emulated, unless `TP_CPU_BF16_GEMM=0` turns
    it off as for the dense layers; float32 tiles (the exact weights) where neither is."""
    monkeypatch.setenv("TP_CPU_BF16_GEMM", switch)
    monkeypatch.setattr(wna16_cpu, "AMX_MIN_TOKENS", 1 << 30)  # the tiles, also where AMX would take the batch
    assert wna16_cpu.tile_dtype(torch.float32) == torch.float32
    kernel_on = (switch == "1" and cpu_sgemm.load() is not None
                 and lacks_native_gemm(torch.zeros(2, 2, dtype=torch.bfloat16)))
    half_gemm = "torch" if cpu_has_avx512_bf16() else "avx2" if kernel_on else "none"
    assert wna16_cpu._half_gemm() == half_gemm
    assert wna16_cpu.tile_dtype(torch.bfloat16) == (torch.float32 if half_gemm == "none" else torch.bfloat16)
    layer, weight = _layer(96, 256, bits, GROUPINGS["act_order_g32"](256))
    layout = get_wna16_layout(layer)
    x = torch.randn(40, 256).bfloat16()  # over GEMV_MAX_TOKENS: the tiled path
    y = apply_wna16(layer, x, None)
    assert y.dtype == torch.bfloat16
    xp = torch.nn.functional.pad(x, (0, 1)).index_select(1, layout.input_perm).contiguous()
    # the C tiles (apply_wna16) hold the values torch's do (no kernel): the same GEMMs
    tiled = wna16_cpu.wna16_matmul(xp, layout, None)
    assert tiled.dtype == wna16_cpu.tile_dtype(torch.bfloat16)
    torch.testing.assert_close(tiled.to(torch.bfloat16), y, atol=0, rtol=0)
    reference = x.float() @ weight.t()
    if tiled.dtype == torch.bfloat16:
        # one GEMM over the whole weight rounded to bfloat16 differs by output rounding
        w_bf16 = dequantize_wna16(layout).bfloat16()
        torch.testing.assert_close(y.float(), (x.float() @ w_bf16.float().t()).bfloat16().float(), atol=2e-3,
                                   rtol=1e-2)
        assert ((y.float() - reference).norm() / reference.norm()).item() < 1e-2  # bfloat16's rounding, no more
    else:
        # float32 throughout: only the output is rounded, by at most one bfloat16 unit
        torch.testing.assert_close(y.float(), reference, atol=1e-5, rtol=2.0**-8)


_KERNEL = wna16_cpu.load()


@pytest.mark.skipif(_KERNEL is None or not _KERNEL.has_amx, reason="no AMX tiles on this CPU (or its compiler)")
@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_tiles_multiply_the_weights_rounded_to_bfloat16(bits: int, grouping: str) -> None:
    """bfloat16 batches of AMX_MIN_TOKENS tokens and more on AMX CPUs: the weights (q - z)
    * s rounded once to bfloat16 (the bfloat16 tiles' values), float32 sums, so the float32
    output is that product up to float32 rounding, for every token count (partial 16- and
    32-token groups), a partial last 32-row block, ragged and act-order groups, and any
    thread count; the tiles' path (the same weights, another summation order) agrees."""
    layer, weight = _layer(77, 320, bits, GROUPINGS[grouping](320), scale_dtype=torch.bfloat16, seed=bits)
    layout = get_wna16_layout(layer)
    w = weight.bfloat16().double()
    for m in (wna16_cpu.AMX_MIN_TOKENS, 16, 17, 33, 70):
        x = torch.randn(m, 320, generator=torch.Generator().manual_seed(m)).bfloat16()
        xp = x if layout.input_perm is None else (  # the layout's order
            torch.nn.functional.pad(x, (0, 1)).index_select(1, layout.input_perm).contiguous())
        y = wna16_cpu.wna16_matmul(xp, layout, _KERNEL)
        assert y.dtype == torch.float32 and torch.equal(y, _KERNEL.amx_matmul(xp, layout))
        exact = x.double() @ w.t()
        bound = 1e-5 * (x.double().abs() @ w.abs().t()).max().item()  # float32 sums
        assert (y.double() - exact).abs().max().item() <= bound
        tiles = wna16_cpu.wna16_matmul(xp, layout, None)  # torch's bfloat16 tiles: bfloat16 out
        torch.testing.assert_close(tiles.float(), y, rtol=2.0**-7, atol=bound)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _KERNEL.amx_matmul(xp, layout)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, y)
    # and through the layer: x in its own order, bfloat16 out (rounded once)
    x = torch.randn(40, 320).bfloat16()
    got = apply_wna16(layer, x, None).float()
    torch.testing.assert_close(got, x.float() @ w.float().t(), atol=1e-4, rtol=2.0**-7)
    reference = x.float() @ weight.t()  # the weights unrounded: bfloat16's rounding apart, no more
    assert ((got - reference).norm() / reference.norm()).item() < 1e-2


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scales_are_kept_in_the_narrowest_exact_dtype_and_read_exactly(scale_dtype: torch.dtype) -> None:
    n, k = 32, 64
    scales = torch.rand(n, 2) * 0.02
    if scale_dtype == torch.float16:
        scales[0, 0] = 3e-6  # a float16 subnormal
    scales = scales.to(scale_dtype).float()
    if scale_dtype == torch.float32:
        scales[1, 1] = 1.0 + 2.0 ** -20  # exact in neither 16-bit type
    if scale_dtype == torch.bfloat16:
        scales[2, 1] = 2.0 ** -30  # below float16's range
    assert compact_scales(scales).dtype == scale_dtype
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, 2))
    layer = nn.Module()
    set_wna16_layout(layer, 4, lambda a, b: codes[a:b], scales, zeros, torch.arange(k) // 32, [])
    weight = (codes - zeros.repeat_interleave(32, 1)).float() * scales.repeat_interleave(32, 1)
    x = torch.eye(k)[:8]  # picks columns: exact products
    torch.testing.assert_close(apply_wna16(layer, x, None), weight.t()[:8].contiguous(), atol=0, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_triton_kernel_under_the_interpreter(bits: int) -> None:
    from models.layers.quantization.kernels.wna16_triton import wna16_matmul_triton

    layer, weight = _layer(80, 128, bits, GROUPINGS["ragged"](128), scale_dtype=torch.bfloat16)
    x = torch.randn(5, 128)
    torch.testing.assert_close(wna16_matmul_triton(x, get_wna16_layout(layer)), x @ weight.t(), atol=2e-5,
                               rtol=1e-5)


def test_int32_packing_follows_autogptq_and_autoawq_bit_order() -> None:
    values = torch.arange(1, 9, dtype=torch.int32).view(8, 1)  # 8 int4 values along dim 0
    assert pack_int32(values, 4, dim=0).item() == 0x87654321 - (1 << 32)  # value j in bits [4j, 4j+4)
    assert torch.equal(unpack_int32(torch.tensor([[0x87654321 - (1 << 32)]], dtype=torch.int32), 4, 0), values)
    # AWQ: nibble j holds output (0, 2, 4, 6, 1, 3, 5, 7)[j] of its 8
    outputs = torch.arange(8, dtype=torch.int32).view(1, 8)
    assert pack_int32(outputs, 4, dim=1, order=AWQ_PACK_ORDER).item() == 0x75316420
    assert torch.equal(unpack_int32(torch.tensor([[0x75316420]], dtype=torch.int32), 4, 1, AWQ_PACK_ORDER), outputs)
    # int8: four to an int32, the first in the low byte
    int8_values = torch.tensor([[1], [2], [3], [255]], dtype=torch.int32)
    assert pack_int32(int8_values, 8, dim=0).item() == 0xFF030201 - (1 << 32)


def test_compressed_tensors_own_unpacking_reads_our_checkpoint_tensors() -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from tests.wna16_formats import ct_quantizer

    for bits, group, sym in ((4, 32, True), (4, 64, False), (8, -1, True), (8, 128, False)):
        w = torch.randn(64, 256) * 0.05
        tensors, deq = ct_quantizer(bits, group, sym)("m", w)
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym,
                                strategy="channel" if group == -1 else "group",
                                group_size=None if group == -1 else group)
        x_q = helpers.unpack_from_int32(tensors["weight_packed"], bits, torch.Size(w.shape))
        zp = None if sym else helpers.unpack_from_int32(tensors["weight_zero_point"], bits,
                                                        torch.Size((64, tensors["weight_scale"].shape[1])),
                                                        packed_dim=0)
        out = dequantize(x_q=x_q, scale=tensors["weight_scale"].float(), zero_point=zp, args=args)
        assert torch.equal(out.float(), deq), (bits, group, sym)


def test_fused_layer_refuses_sub_projections_with_different_g_idx() -> None:
    param = nn.Parameter(torch.empty(8, dtype=torch.int32), requires_grad=False)
    load = fused_replica_loader(lambda p, t: None, fused=True)
    g_idx = torch.arange(8, dtype=torch.int32) // 4
    load(param, g_idx, "q")
    load(param, g_idx.clone(), "k")
    with pytest.raises(WeightLoadError, match="sub-projection 'v'"):
        load(param, g_idx.flip(0), "v")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_layout_and_triton_kernel_on_the_gpu(bits: int) -> None:
    """The layout built on the GPU (g_idx, padding) and the compiled Triton kernel."""
    k, n = 512, 384
    groups = GROUPINGS["ragged"](k)
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, 13, generator=gen) * 0.02 + 1e-3).half().float()
    zeros = torch.randint(0, 1 << bits, (n, 13), generator=gen)
    weight = (codes - zeros[:, groups]).float() * scales[:, groups]
    layer = nn.Module()
    set_wna16_layout(layer, bits, lambda a, b: codes[a:b].cuda(), scales.cuda(), zeros.cuda(), groups.cuda(), [])
    assert get_wna16_layout(layer).qweight.is_cuda and get_wna16_layout(layer).block_group.is_cuda
    for m in (1, 7, 64):
        x = torch.randn(m, k, generator=gen)
        expected = x @ weight.t()
        torch.testing.assert_close(apply_wna16(layer, x.cuda(), None).cpu(), expected, atol=1e-4, rtol=1e-4)
        y16 = apply_wna16(layer, x.cuda().bfloat16(), None).float().cpu()
        torch.testing.assert_close(y16, expected, atol=0.1, rtol=0.05)


def test_a_replaced_buffer_is_read_by_the_next_forward() -> None:
    """The forward's cached view of the buffers follows a buffer that is replaced (as
    sleep mode or a reload may do): never a stale tensor."""
    layer, weight = _layer(64, 128, 4, torch.arange(128) // 64)
    x = torch.randn(3, 128)
    torch.testing.assert_close(apply_wna16(layer, x, None), x @ weight.t(), atol=2e-5, rtol=1e-5)
    layer.wna16_scales = layer.wna16_scales * 2  # a new tensor under the same buffer name
    assert "wna16_scales" in dict(layer.named_buffers())
    torch.testing.assert_close(apply_wna16(layer, x, None), 2 * (x @ weight.t()), atol=4e-5, rtol=1e-5)
