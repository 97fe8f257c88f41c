"""The CPU fused-op kernels (models/layers/cpu_ops.py, .c): residual add + RMSNorm, the
neox rotary embedding (alone and after Qwen3's q/k norm), and the row-wise argmax of
greedy sampling.

The rotary must equal the layer's torch ops bit for bit (it rounds where they round), the
norm to a few units in the last place (its sum of squares adds up in another order); the
residual sum must be exact; the argmax must give torch's max values and first indices,
ties, NaNs and infinities included. Results must not depend on the thread count; tensors the kernels do
not take must reach the torch ops untouched; a failed build must fall back.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from models.layers import cpu_ops
from models.layers.layernorm import RMSNorm
from models.layers.rotary_embedding import RotaryEmbedding

KERNEL = cpu_ops.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler on this machine")


@pytest.fixture
def torch_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside: the layers run their torch ops (the kernels switched off)."""
    monkeypatch.setenv("TP_CPU_FUSED_OPS", "0")
    cpu_ops.load.cache_clear()
    assert cpu_ops.load() is None
    yield
    monkeypatch.delenv("TP_CPU_FUSED_OPS")
    cpu_ops.load.cache_clear()


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.rand(hidden, generator=torch.Generator().manual_seed(hidden)) + 0.5).to(dtype)
    return norm


def _norm_outputs(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> list[torch.Tensor]:
    alone = norm(x.clone())
    summed = x.clone()
    out, total = norm(summed, residual)
    assert total is summed  # the sum is written into x, as vLLM's fused add-norm does
    return [alone, out, total]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (3, 768), (32, 768), (300, 1000), (2048, 64), (5, 1003)])
def test_rms_norm_equals_the_torch_ops(request, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    norm = _norm(hidden, dtype)
    fused = _norm_outputs(norm, x, residual)
    request.getfixturevalue("torch_ops")
    plain = _norm_outputs(norm, x, residual)
    assert torch.equal(fused[2], plain[2])  # x + residual, rounded to the dtype
    ulp = torch.finfo(dtype).eps  # a few: the sum of squares and the scaling round in another order
    for got, expected in zip(fused[:2], plain[:2]):
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), rtol=4 * ulp, atol=4 * ulp)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,heads,kv_heads,scaling", [
    (64, 12, 4, None),
    (128, 2, 1, None),
    (80, 3, 3, None),
    (36, 2, 2, None),  # halves of 18: 8 at a time and a tail
    (64, 8, 2, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
])
def test_rotary_equals_the_torch_ops_bit_for_bit_on_views_of_the_qkv_projection(request, dtype, head_size, heads,
                                                                             kv_heads, scaling):
    rotary = RotaryEmbedding(head_size, 300, 10000.0, scaling)
    sizes = [heads * head_size, kv_heads * head_size, kv_heads * head_size]
    results = []
    for plain in (False, True):
        if plain:
            request.getfixturevalue("torch_ops")
        for tokens in (1, 7, 260):
            gen = torch.Generator().manual_seed(tokens)
            qkv = torch.randn(tokens, sum(sizes), generator=gen).to(dtype)
            positions = torch.randint(0, 300, (tokens,), generator=gen)
            q, k, v = qkv.split(sizes, dim=-1)  # strided views, as the attention layer has them
            rotary(positions, q, k)
            results.append(qkv)
    for fused, plain in zip(results[:3], results[3:]):
        assert torch.equal(fused, plain)  # v untouched too


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,heads,kv_heads", [(64, 16, 4), (128, 2, 1), (64, 1, 1)])
def test_qk_norm_rope_equals_the_separate_calls_bit_for_bit(request, monkeypatch, dtype, head_size, heads,
                                                             kv_heads):
    """Qwen3's q/k norm and rotary in one call, in place on the strided q/k views of the
    qkv projection: each head's values exactly those of the separate norm and rotary
    calls on a copy of one row per head (v untouched), and within the norm's few units in
    the last place of the torch ops."""
    rotary = RotaryEmbedding(head_size, 300, 1000000.0)
    q_norm, k_norm = _norm(head_size, dtype), _norm(head_size, dtype)
    k_norm.weight.data = k_norm.weight.data.flip(0)  # a different weight from q's
    sizes = [heads * head_size, kv_heads * head_size, kv_heads * head_size]

    def separate(positions, q, k):
        q = q_norm(q.reshape(-1, head_size)).view(q.shape)
        k = k_norm(k.reshape(-1, head_size)).view(k.shape)
        return rotary(positions, q, k)

    calls = []
    real = cpu_ops.CpuOpsKernel.qk_norm_rope
    monkeypatch.setattr(cpu_ops.CpuOpsKernel, "qk_norm_rope", lambda *a: calls.append(1) or real(*a))
    for tokens in (1, 16, 300):
        gen = torch.Generator().manual_seed(tokens)
        qkv = (torch.randn(tokens, sum(sizes), generator=gen) * 3).to(dtype)
        positions = torch.randint(0, 300, (tokens,), generator=gen)
        fused_qkv, expected_qkv = qkv.clone(), qkv.clone()
        q, k, _ = fused_qkv.split(sizes, dim=-1)
        got = rotary.forward_after_qk_norm(positions, q, k, q_norm, k_norm, head_size)
        assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr()  # in place
        want = separate(positions, *expected_qkv.split(sizes, dim=-1)[:2])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), tokens
        assert torch.equal(fused_qkv[:, -sizes[2]:], qkv[:, -sizes[2]:])  # v untouched
    assert len(calls) == 3  # the kernel took every call
    request.getfixturevalue("torch_ops")
    plain = separate(positions, *qkv.clone().split(sizes, dim=-1)[:2])
    ulp = torch.finfo(dtype).eps
    for a, b in zip(got, plain):
        torch.testing.assert_close(a.float(), b.float(), rtol=8 * ulp, atol=8 * ulp)


@needs_kernel
def test_qk_norm_rope_position_past_the_table_and_what_it_does_not_take():
    rotary = RotaryEmbedding(8, 10, 10000.0)
    q_norm, k_norm = _norm(8, torch.float32), _norm(8, torch.float32)
    q, k = torch.randn(3, 16), torch.randn(3, 8)
    before = (q.clone(), k.clone())
    with pytest.raises(IndexError, match="10 positions"):
        rotary.forward_after_qk_norm(torch.tensor([1, 10, 2]), q, k, q_norm, k_norm, 8)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    # a weight of another dtype: the kernel declines, the separate path runs
    assert not KERNEL.qk_norm_rope(q, k, 8, q_norm.weight.bfloat16(), k_norm.weight, 1e-5, torch.tensor([0, 1, 2]),
                                   rotary.cos_cached, rotary.sin_cached)
    assert torch.equal(q, before[0])
    k_norm.weight.data = k_norm.weight.data.bfloat16()
    got = rotary.forward_after_qk_norm(torch.tensor([0, 1, 2]), q.clone(), k.clone(), q_norm, k_norm, 8)
    assert got[1].dtype == torch.float32  # the torch norm's promotion (float32 x, bfloat16 weight)


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 768, generator=gen).bfloat16()
    residual = torch.randn(512, 768, generator=gen).bfloat16()
    qkv = torch.randn(512, 1280, generator=gen)
    positions = torch.randint(0, 1000, (512,), generator=gen)
    norm, rotary = _norm(768, torch.bfloat16), RotaryEmbedding(64, 1000, 10000.0)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            rotated = qkv.clone()
            q, k, _ = rotated.split([768, 256, 256], dim=-1)
            rotary(positions, q, k)
            outs.append((*_norm_outputs(norm, x, residual), rotated, *KERNEL.argmax_rows(qkv, 1280)))
    finally:
        torch.set_num_threads(threads)
    for result in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result, outs[0]))


@needs_kernel
def test_tensors_the_kernels_do_not_take_are_left_to_torch():
    norm = _norm(16, torch.float64)
    x = torch.randn(4, 16).double()
    assert KERNEL.rms_norm(x, None, norm.weight, 1e-5) is None  # float64: not a kernel dtype
    wide = torch.randn(4, 32)
    assert KERNEL.rms_norm(wide[:, ::2], None, _norm(16, torch.float32).weight, 1e-5) is None  # strided last dim
    assert KERNEL.rms_norm(torch.randn(4, 16), None, norm.weight, 1e-5) is None  # weight of another dtype
    before = wide.clone()
    rotary = RotaryEmbedding(8, 10, 10000.0)
    assert not KERNEL.rotary_neox(wide[:, ::2], wide[:, 1::2], 8, torch.arange(4), rotary.cos_cached,
                                  rotary.sin_cached)
    assert torch.equal(wide, before)
    # The layers still give their results through the torch ops.
    torch.testing.assert_close(norm(x), norm.weight * torch.nn.functional.rms_norm(x.float(), (16,), eps=1e-5).double())


def _torch_first_max(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x[:, :n].float().max(dim=-1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width,n", [(1, 1, 1), (1, 15, 15), (3, 17, 17), (32, 16000, 16000), (32, 32064, 32000),
                                         (5, 1000, 333), (64, 4099, 4099)])
def test_argmax_rows_gives_torchs_values_and_first_indices(dtype, rows, width, n):
    gen = torch.Generator().manual_seed(rows * width + n)
    # A coarse grid of values, so that most rows hold their maximum more than once.
    x = (torch.randint(-40, 8, (rows, width), generator=gen).float() / 4).to(dtype)
    values, ids = KERNEL.argmax_rows(x, n)
    ref_values, ref_ids = _torch_first_max(x, n)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    assert torch.equal(values, ref_values)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_on_ties_nans_infinities_signed_zeros_and_strided_rows(dtype):
    n = 100
    x = torch.zeros(8, 128)
    x[0, 40] = x[0, 7] = x[0, 93] = 5.0  # the first of three ties
    x[1, 3], x[1, 60] = float("nan"), float("nan")  # the first NaN, whatever else the row holds
    x[1, 10] = float("inf")
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 50] = float("inf")
    x[4] = -1.0
    x[4, 20], x[4, 37] = -0.0, 0.0  # -0.0 == 0.0: the first
    x[5, 99] = 1.0  # the last column counted
    x[5, 100:] = 9.0  # past n: not counted
    x[6, 16] = 2.0  # the first element of the second lane block
    x[7, 15] = x[7, 31] = 3.0
    x = x.to(dtype)
    values, ids = KERNEL.argmax_rows(x, n)
    ref_values, ref_ids = _torch_first_max(x, n)
    assert ids.tolist() == ref_ids.tolist() == [7, 3, 0, 50, 20, 99, 16, 15]
    assert torch.equal(values.isnan(), ref_values.isnan())
    assert torch.equal(values.nan_to_num(), ref_values.nan_to_num())
    strided = torch.randn(6, 300).to(dtype)[:, 5:205]  # rows 300 apart
    assert torch.equal(KERNEL.argmax_rows(strided, 200)[1], _torch_first_max(strided, 200)[1])


@needs_kernel
def test_argmax_rows_refuses_what_it_does_not_take():
    assert KERNEL.argmax_rows(torch.randn(4, 16).double(), 16) is None  # not a kernel dtype
    assert KERNEL.argmax_rows(torch.randn(4, 32)[:, ::2], 16) is None  # strided last dim
    assert KERNEL.argmax_rows(torch.randn(2, 3, 4), 4) is None  # not 2-D
    assert KERNEL.argmax_rows(torch.randn(4, 16), 0) is None
    assert KERNEL.argmax_rows(torch.randn(4, 16), 17) is None


@needs_kernel
def test_a_position_past_the_table_is_an_error_before_anything_is_written():
    rotary = RotaryEmbedding(8, 10, 10000.0)
    q, k = torch.randn(3, 16), torch.randn(3, 8)
    before = (q.clone(), k.clone())
    with pytest.raises(IndexError, match="10 positions"):
        rotary(torch.tensor([1, 10, 2]), q, k)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_a_failed_build_falls_back_to_torch_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level("WARNING"):
        assert cpu_ops.build_or_load() is None
    assert "fused-op kernels unavailable" in caplog.text
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))


def test_disabled_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TP_RUNTIME_CACHE", str(tmp_path))
    monkeypatch.setenv("TP_CPU_FUSED_OPS", "0")
    assert cpu_ops.build_or_load() is None
    assert not list(tmp_path.iterdir())
