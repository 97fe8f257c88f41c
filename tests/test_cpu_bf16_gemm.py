"""The bfloat16 GEMM that reads the weight in the checkpoint's layout (models/layers/cpu_bf16_gemm.py).

Each output of the kernel must be the float32 sum rounded once to bfloat16: within half a
bfloat16 unit of the exact (float64) product, plus float32 rounding, for every row count
up to MAX_ROWS, every tile remainder (rows and tokens not multiples of 4, K not a multiple
of 32), with and without bias, for strided inputs and a weight that is a view of a wider
one; the same of the AMX tiles (amx_bf16.c, where the CPU has them) for every row count
up to AMX_MAX_ROWS and past it, partial 32-row blocks and 16-token groups, whatever the
thread count. `linear` is the VDPBF16PS kernel up to `dot_max_rows()`, the AMX tiles
above where the library has them, and F.linear itself past those. A bf16 model loads with its weights as they
were read (no packed copy: parameter storage is the plain model's) and gives the logits of the
plain model, for an untied and a tied LM head.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.arg_utils import create_engine_config
from engine.tiny_model import make_tiny_model
from model_loader import get_model
from models.layers import cpu_bf16_gemm
from models.layers.linear import LinearBase

pytestmark = pytest.mark.skipif(cpu_bf16_gemm.load() is None,
                                reason="no AVX-512 BF16 on this CPU (or no C compiler): bf16 weights are packed")


def assert_rounded_once(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """got is the exact product rounded to bfloat16 (half a unit: at most 2^-8 relative), up to
    float32 accumulation error."""
    exact = x.double() @ weight.double().T
    if bias is not None:
        exact += bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    scale = (x.double().abs() @ weight.double().abs().T).max().item()  # what float32 rounding scales with
    err = (got.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 + 1e-5 * scale
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("n, k", [(4, 32), (37, 100), (130, 31), (5, 2048), (64, 1000)])
def test_every_row_count_and_tile_remainder_rounds_the_float32_sum_once(n, k):
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    kernel = cpu_bf16_gemm.load()
    for rows in [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, cpu_bf16_gemm.MAX_ROWS]:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        for b in (None, bias):
            got = kernel.linear(x, weight, b)
            assert_rounded_once(got, x, weight, b)
            if rows <= cpu_bf16_gemm.dot_max_rows():  # what the layers call: the kernel itself
                assert torch.equal(cpu_bf16_gemm.linear(x, weight, b), got)


def test_strided_inputs_views_and_3d_batches():
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(96, 160, generator=gen).bfloat16()
    weight = fused[:, 16:144]  # a view: rows 160 apart, unit stride along the input
    assert not weight.is_contiguous() and cpu_bf16_gemm.serves(weight)
    wide = torch.randn(9, 200, generator=gen).bfloat16()
    x = wide[:, :128]  # input rows 200 apart
    assert_rounded_once(cpu_bf16_gemm.load().linear(x, weight, None), x, weight, None)
    assert_rounded_once(cpu_bf16_gemm.linear(x, weight), x, weight, None)
    x3 = torch.randn(2, 3, 128, generator=gen).bfloat16()  # 6 rows: the kernel on every CPU
    got = cpu_bf16_gemm.linear(x3, weight)
    assert got.shape == (2, 3, 96)
    assert_rounded_once(got.reshape(6, 96), x3.reshape(6, 128), weight, None)


def test_above_max_rows_and_other_dtypes_it_is_f_linear():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    kernel = cpu_bf16_gemm.load()
    past = cpu_bf16_gemm.AMX_MAX_ROWS if kernel.has_amx else cpu_bf16_gemm.dot_max_rows()
    x = torch.randn(past + 1, 64, generator=gen).bfloat16()
    assert torch.equal(cpu_bf16_gemm.linear(x, weight), F.linear(x, weight))
    if kernel.has_amx:  # an input width the tiles do not take: F.linear at their row counts too
        odd = torch.randn(48, 80, generator=gen).bfloat16()
        x = torch.randn(cpu_bf16_gemm.dot_max_rows() + 1, 80, generator=gen).bfloat16()
        assert kernel.amx_linear(x, odd, None) is None
        assert torch.equal(cpu_bf16_gemm.linear(x, odd), F.linear(x, odd))
    xf = torch.randn(3, 64, generator=gen)
    assert torch.equal(cpu_bf16_gemm.linear(xf, weight.float()), F.linear(xf, weight.float()))
    assert not cpu_bf16_gemm.serves(weight.float()) and not cpu_bf16_gemm.serves(weight.T)


@pytest.mark.parametrize("ours, flags, tiles, isa, expected", [
    (True, "fpu avx512f avx512_bf16 amx_bf16 amx_tile", True, None, "AMX_DOT_MAX_ROWS"),  # our tiles from 5 rows
    (False, "fpu avx512f avx512_bf16 amx_bf16 amx_tile", True, None, "ONEDNN_AMX_MAX_ROWS"),
    (False, "fpu avx512f avx512_bf16 amx_bf16 amx_tile", True, "AVX10_1_512_AMX", "ONEDNN_AMX_MAX_ROWS"),
    (False, "fpu avx512f avx512_bf16 amx_bf16 amx_tile", True, "AVX512_CORE_BF16", "MAX_ROWS"),  # oneDNN stops below
    (False, "fpu avx512f avx512_bf16 amx_bf16 amx_tile", False, None, "MAX_ROWS"),  # the kernel refused the tiles
    (False, "fpu avx512f avx512_bf16", True, None, "MAX_ROWS"),  # AVX-512 BF16 only: oneDNN runs VDPBF16PS as we do
])
def test_the_vdpbf16ps_kernel_stops_early_where_amx_multiplies(monkeypatch, ours, flags, tiles, isa, expected):
    monkeypatch.setattr(cpu_bf16_gemm, "load", lambda: SimpleNamespace(has_amx=ours))
    monkeypatch.setattr(cpu_bf16_gemm, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: tiles, raising=False)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert cpu_bf16_gemm.dot_max_rows.__wrapped__() == getattr(cpu_bf16_gemm, expected)
    assert cpu_bf16_gemm.AMX_DOT_MAX_ROWS < cpu_bf16_gemm.ONEDNN_AMX_MAX_ROWS < cpu_bf16_gemm.MAX_ROWS


_KERNEL = cpu_bf16_gemm.load()
needs_amx = pytest.mark.skipif(_KERNEL is None or not _KERNEL.has_amx,
                               reason="no AMX tiles on this CPU (or its compiler): VDPBF16PS only")


@needs_amx
@pytest.mark.parametrize("n, k", [(32, 32), (5, 64), (48, 96), (100, 2048), (131, 320)])
def test_the_amx_tiles_round_the_float32_sum_once(n, k):
    gen = torch.Generator().manual_seed(n + k)
    kernel = cpu_bf16_gemm.load()
    wide = torch.randn(n, k + 64, generator=gen).bfloat16()
    for weight in (wide[:, :k].contiguous(), wide[:, 32 : 32 + k]):  # packed rows, and rows k + 64 apart
        bias = torch.randn(n, generator=gen).bfloat16()
        for rows in [1, 2, 5, 15, 16, 17, 31, 32, 33, 48, cpu_bf16_gemm.AMX_MAX_ROWS, 100]:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            for b in (None, bias):
                got = kernel.amx_linear(x, weight, b)
                assert_rounded_once(got, x, weight, b)
                if cpu_bf16_gemm.dot_max_rows() < rows <= cpu_bf16_gemm.AMX_MAX_ROWS:  # what the layers call
                    assert torch.equal(cpu_bf16_gemm.linear(x, weight, b), got)


@needs_amx
def test_the_amx_tiles_do_not_depend_on_the_thread_count_or_the_input_rows_stride():
    gen = torch.Generator().manual_seed(3)
    kernel = cpu_bf16_gemm.load()
    weight = torch.randn(200, 512, generator=gen).bfloat16()
    wide = torch.randn(40, 600, generator=gen).bfloat16()
    x = wide[:, :512]  # input rows 600 apart
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.amx_linear(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernel.amx_linear(x.contiguous(), weight, None), one)
    assert_rounded_once(one, x, weight, None)


def test_the_switch_turns_it_off_for_weights_loaded_after(monkeypatch):
    weight = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert cpu_bf16_gemm.serves(weight)
    monkeypatch.setenv(cpu_bf16_gemm.SWITCH, "0")
    assert not cpu_bf16_gemm.serves(weight)


SPEC: dict[str, Any] = dict(hidden_size=160, intermediate_size=300, num_hidden_layers=2, num_attention_heads=5,
                            num_key_value_heads=1, vocab_size=333, init_std=0.1, with_tokenizer=False)


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16_gemm")
    return {"llama": make_tiny_model(root / "llama", "llama", seed=5, dtype="bfloat16", **SPEC),
            "tied": make_tiny_model(root / "tied", "qwen2", seed=6, dtype="bfloat16", tie_word_embeddings=True,
                                    **SPEC)}


def load(model_dir: Path, **kwargs: Any) -> torch.nn.Module:
    return get_model(create_engine_config(model=str(model_dir), device="cpu", dtype="bfloat16",
                                          use_tqdm_on_load=False, **kwargs))


def parameter_bytes(model: torch.nn.Module) -> int:
    params = {id(p): p for p in model.parameters()}.values()  # a tied table once
    return sum(p.untyped_storage().nbytes() for p in params)


@pytest.mark.parametrize("name", ["llama", "tied"])
def test_a_bf16_model_keeps_its_loaded_weights_and_gives_the_plain_logits(bf16_models, name):
    model = load(bf16_models[name])
    plain = load(bf16_models[name], cpu_prepack_weights=False)
    layers = [m for m in model.modules() if isinstance(m, LinearBase)] + [model.lm_head]
    for layer in layers:
        assert layer.quant_method.row_major and type(layer.weight) is torch.nn.Parameter
    if name == "tied":  # one table, shared by the embedding and the head
        assert model.lm_head.weight is model.model.embed_tokens.weight
    # Every parameter holds only its own values: no packed layout, no padding, no copy.
    assert parameter_bytes(model) == parameter_bytes(plain) == sum(p.numel() * 2 for p in plain.parameters())
    for length in (1, 6, 20, cpu_bf16_gemm.AMX_MAX_ROWS + 9):  # decode rows, a batch's, F.linear's prefill
        ids = torch.randint(0, 333, (length,), generator=torch.Generator().manual_seed(length))
        with torch.inference_mode():
            got = model.compute_logits(model(ids, torch.arange(length)))
            expected = plain.compute_logits(plain(ids, torch.arange(length)))
        # Each layer's output may round differently by a bf16 unit; the logits stay close.
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.03,
                                   atol=0.03 * expected.float().abs().max().item())
