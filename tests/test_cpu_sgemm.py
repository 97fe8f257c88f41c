"""The AVX2 float32 GEMM for packed weights (models/layers/cpu_sgemm.py, .c).

Its product must equal F.linear computed in float64 for every row count a step can
bring (decode batches, the equal-tile splits, row blocks of 192 and what follows them),
for widths that are not a multiple of its 16-column panels and odd depths, with and
without bias; its results must not depend on the thread count; bad input must be
refused; and `default_packed_gemm` must pick it only where it runs, falling back to
oneDNN when it cannot be built.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distributed.native_build import load_kernel
from models.layers import cpu_sgemm
from models.layers.cpu_gemm import PackedWeight, default_packed_gemm

KERNEL = cpu_sgemm.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX2/FMA or no C compiler on this machine")

ROWS = [*range(1, 14), 31, 32, 33, 64, 96, 97, 191, 192, 193, 400]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_kernel
@pytest.mark.parametrize("shape", [(16, 8), (100, 37), (33, 1), (1280, 768), (8, 2048)])
def test_product_equals_float64_linear_for_every_row_count(shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = KERNEL.pack(weight)
    assert packed.numel() == -(-n // 16) * 16 * k
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        for b in (None, bias):
            got = KERNEL.linear(x, packed, n, b)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            # float32 accumulation in k order: errors grow like sqrt(k); a wrong element is off by O(1)
            torch.testing.assert_close(got.double(), reference(x, weight, b), rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
def test_leading_dims_strided_input_and_empty_batches():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen)
    packed = KERNEL.pack(weight)
    x = torch.randn(3, 5, 48, generator=gen)[..., ::2]  # strided along k
    got = KERNEL.linear(x, packed, 40)
    assert got.shape == (3, 5, 40)
    torch.testing.assert_close(got.double(), reference(x, weight, None), rtol=1e-5, atol=1e-5)
    rows = torch.randn(7, 2, 24, generator=gen)[:, 0]  # a row stride that is not k
    torch.testing.assert_close(KERNEL.linear(rows, packed, 40).double(), reference(rows, weight, None),
                               rtol=1e-5, atol=1e-5)
    assert KERNEL.linear(torch.empty(0, 24), packed, 40).shape == (0, 40)


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(250, 96, generator=gen)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            packed = KERNEL.pack(weight)
            results.append((packed, KERNEL.linear(x, packed, 200, bias)))
    finally:
        torch.set_num_threads(threads)
    for packed, out in results[1:]:
        assert torch.equal(packed, results[0][0]) and torch.equal(out, results[0][1])


@needs_kernel
def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="float32"):
        KERNEL.pack(torch.zeros(16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        KERNEL.pack(torch.zeros(16))
    packed = KERNEL.pack(torch.zeros(16, 8))
    with pytest.raises(ValueError, match="does not fit"):
        KERNEL.linear(torch.zeros(2, 9), packed, 16)


@needs_kernel
def test_packed_weight_uses_it_for_every_row_count():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(48, 32, generator=gen)
    packed = PackedWeight(weight, "avx2")
    assert packed.verify(weight)
    for rows in (1, 32, 97, 500):
        x = torch.randn(rows, 32, generator=gen)
        expected = KERNEL.linear(x, packed.packed, 48)
        assert torch.equal(packed.linear(x, weight), expected)  # not F.linear above PACKED_MAX_ROWS
        assert torch.equal(packed.linear_any_rows(x), expected)


def test_default_kernel_follows_the_cpu(monkeypatch):
    monkeypatch.delenv("TP_CPU_PACKED_GEMM", raising=False)
    fits = cpu_sgemm.cpu_has_avx2() and not cpu_sgemm.cpu_has_avx512() and KERNEL is not None
    expected = "avx2" if fits else "onednn"  # MKL only when chosen: it cannot pack in place
    assert default_packed_gemm() == expected
    for choice in ("mkl", "onednn"):
        monkeypatch.setenv("TP_CPU_PACKED_GEMM", choice)
        assert default_packed_gemm() == choice


def test_an_avx2_kernel_that_cannot_be_built_falls_back_to_onednn(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path / "cache"))
    cc = tmp_path / "fake-cc"
    cc.write_text('#!/bin/sh\necho "cpu_sgemm.c:1: error: nope" >&2\nexit 1\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level("WARNING"):
        built = cpu_sgemm.build_or_load()
    assert built is None
    if cpu_sgemm.cpu_has_avx2():
        assert "sgemm kernel unavailable" in caplog.text and "nope" in caplog.text
    kernels = Path(tmp_path / "cache" / "kernels")
    assert not kernels.exists() or not list(kernels.iterdir())  # no build directory left
    monkeypatch.setattr(cpu_sgemm, "load", lambda: None)  # as in a process where the build failed
    monkeypatch.setenv("TP_CPU_PACKED_GEMM", "avx2")
    assert default_packed_gemm() in ("mkl", "onednn")
    monkeypatch.delenv("TP_CPU_PACKED_GEMM")
    assert default_packed_gemm() in ("mkl", "onednn")


# ---- 16-bit weights read where they were loaded (`linear_half`) ----

# One row; AVX-512's 16-lane tiles (2-32 rows, groups of <= 4) or AVX2's dot products (<= 16,
# groups of <= 6); widened panels (blocks of 192).
HALF_ROWS = [1, 2, 3, 4, 5, 6, 7, 11, 13, 16, 17, 31, 32, 33, 193, 400]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(16, 8), (37, 29), (100, 37), (33, 1), (1280, 768)])
def test_half_weight_product_equals_float64_linear_for_every_row_count(dtype, shape):
    """Each 16-bit value widens exactly, so the product is F.linear on the float32 values
    to float32 rounding, for odd widths and depths (tails of 8 values, of 2 rows and of
    16-row panels), with and without bias."""
    n, k = shape
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
    for rows in HALF_ROWS:
        x = torch.randn(rows, k, generator=gen)
        for b in (None, bias):
            got = KERNEL.linear_half(x, weight, b)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), reference(x, weight.float(), b), rtol=1e-5,
                                       atol=1e-5 * k ** 0.5)


@pytest.mark.skipif(not cpu_sgemm.cpu_has_avx512() or KERNEL is None, reason="this build has no AVX-512 path")
def test_half_weight_product_of_the_avx2_build(tmp_path, monkeypatch):
    """The same source built without AVX-512 (what an AVX2 CPU builds: dot products up
    to 16 rows) gives the product too, here where this CPU's own build takes the 16-lane
    tiles."""
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    avx2 = load_kernel(cpu_sgemm.SOURCES, cpu_sgemm.COMPILE_FLAGS + ("-mno-avx512f",), cpu_sgemm.LINK_FLAGS, (),
                       cpu_sgemm.CpuSgemmKernel, "no build: %s")
    assert avx2 is not None
    for dtype in (torch.bfloat16, torch.float16):
        for n, k in ((37, 29), (100, 37), (1280, 768)):
            gen = torch.Generator().manual_seed(n * 1000 + k)
            weight, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
            for rows in HALF_ROWS:
                x = torch.randn(rows, k, generator=gen)
                torch.testing.assert_close(avx2.linear_half(x, weight, bias).double(),
                                           reference(x, weight.float(), bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
def test_half_weight_rows_at_a_stride_and_16bit_activations():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(50, 80, generator=gen).bfloat16()
    weight = wide[:, 3:43]  # rows 80 apart: a view, read in place
    assert weight.stride() == (80, 1)
    for rows in (1, 2, 9):  # 1: the one-row path (dot_row1)
        x = torch.randn(rows, 40, generator=gen).bfloat16()
        expected = reference(x.float(), weight.float(), None)
        torch.testing.assert_close(KERNEL.linear_half(x, weight).double(), expected, rtol=1e-5, atol=1e-4)
        got = cpu_sgemm.linear_half(x, weight)  # the layers' entry: x's dtype, rounded once
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, KERNEL.linear_half(x, weight).bfloat16())


@needs_kernel
def test_half_weight_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(200, 96, generator=gen).bfloat16(), torch.randn(200, generator=gen)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 3, 20, 250):
            x = torch.randn(rows, 96, generator=gen)
            results = []
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                results.append(KERNEL.linear_half(x, weight, bias))
            assert all(torch.equal(r, results[0]) for r in results[1:])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_half_weight_bad_input_is_refused_and_other_weights_take_f_linear():
    with pytest.raises(ValueError, match="bfloat16/float16"):
        KERNEL.linear_half(torch.zeros(2, 8), torch.zeros(16, 8))
    with pytest.raises(ValueError, match="unit stride"):
        KERNEL.linear_half(torch.zeros(2, 8), torch.zeros(8, 16, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="do not fit"):
        KERNEL.linear_half(torch.zeros(2, 9), torch.zeros(16, 8, dtype=torch.bfloat16))
    x, weight = torch.randn(3, 8), torch.randn(4, 8)  # float32: not this kernel's
    assert torch.equal(cpu_sgemm.linear_half(x, weight), F.linear(x, weight))
