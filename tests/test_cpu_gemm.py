"""Packed float32 GEMM on the CPU (models/layers/cpu_gemm.py): MKL, oneDNN and the avx2 kernel.

The packed product must equal F.linear (to float32 reassociation) for every row count
it serves, with and without bias and for 3-D input: oneDNN's and the avx2 kernel's every
row count, MKL's up to PACKED_MAX_ROWS, above which it must be F.linear itself. Loading
packs every unquantised float32 linear layer and the LM head (tied or not) with the
default kernel and nothing else, leaves `state_dict()` unchanged, gives the logits of an
unpacked model, and is switched off by `cpu_prepack_weights=False`.
Weights changed after loading take effect (in place, or once `prepack_cpu_weights` runs
again). Packing in place itself: tests/test_cpu_packing_in_place.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.arg_utils import create_engine_config
from engine.tiny_model import make_tiny_model
from model_loader import get_model
from models.layers import cpu_bf16_gemm, cpu_sgemm
from models.layers.cpu_gemm import (
    NATIVE_HALF_MAX_ROWS,
    PACKED_MAX_ROWS,
    PackedWeight,
    default_packed_gemm,
    half_linear_rows,
    lacks_native_gemm,
    mkl_packing_available,
    native_half_gemm,
    onednn_rows,
    packing_available,
    reusing_upcast_buffer,
    upcast_float32,
    upcast_gemm,
    widens_half_weights,
)
from models.layers.linear import LinearBase
from models.layers.packed_tensor import PackedTensor
from models.layers.quantization.fp8 import Fp8LinearMethod
from models.layers.unquantized import CPUUnquantizedLinearMethod, prepack_cpu_weights
from models.layers.vocab_parallel_embedding import ParallelLMHead


def load(model_dir: Path, **kwargs: Any) -> torch.nn.Module:
    kwargs.setdefault("dtype", "float32")
    return get_model(create_engine_config(model=str(model_dir), device="cpu", use_tqdm_on_load=False, **kwargs))


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


def linears(model: torch.nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def is_packed(layer: torch.nn.Module) -> bool:
    """Whether the layer's weight is held packed (MKL: with a packed copy beside it)."""
    method = layer.quant_method
    return isinstance(method, CPUUnquantizedLinearMethod) and method.packed is not None


def test_mkl_and_onednn_packing_are_available():
    # CI's torch (the x86 CPU wheel) has MKL and oneDNN; without them nothing is packed.
    assert mkl_packing_available() and packing_available("onednn")


@pytest.mark.parametrize("kernel", ["mkl", "onednn", "avx2"])
@pytest.mark.parametrize("shape", [(96, 64), (320, 128), (1280, 768)])
def test_packed_linear_matches_f_linear_for_every_row_count(shape, kernel):
    if not packing_available(kernel):
        pytest.skip(f"{kernel} packing is not available in this torch build")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    packed = PackedWeight(weight, kernel)
    assert packed.verify(weight)
    for rows in [*range(1, 40), 63, 64, 65, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 300, 2048]:
        x = torch.randn(rows, shape[1], generator=gen)
        for b in (None, bias):
            expected = F.linear(x, weight, b)
            got = packed.linear(x, weight, b)
            assert got.shape == expected.shape
            if rows > PACKED_MAX_ROWS and kernel == "mkl":
                assert torch.equal(got, expected), rows  # the plain path itself
            else:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4 * shape[1] ** 0.5)
    # Leading dimensions are flattened like F.linear does; a strided input is fine.
    x = torch.randn(3, 5, shape[1] * 2, generator=gen)[..., : shape[1]]
    torch.testing.assert_close(packed.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-3)
    empty = torch.empty(0, shape[1])
    assert packed.linear(empty, weight).shape == (0, shape[0])


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_tied"])
def test_loading_packs_linears_and_lm_head_and_keeps_logits(name, tiny_models):
    plain = load(tiny_models[name], cpu_prepack_weights=False)
    packed = load(tiny_models[name])
    assert all(is_packed(m) for m in linears(packed))
    assert {m.quant_method.packed.kernel for m in linears(packed)} == {default_packed_gemm()}
    assert not any(is_packed(m) for m in linears(plain))
    lm_head = packed.lm_head
    assert isinstance(lm_head, ParallelLMHead) and is_packed(lm_head)
    assert not is_packed(plain.lm_head)
    if name == "qwen2_tied":  # the embedding still reads the shared weight, packed in place for both
        assert lm_head.weight is packed.model.embed_tokens.weight
        assert isinstance(lm_head.weight, PackedTensor)
    # Packing adds no parameter or buffer: checkpoints saved from the model are unchanged.
    assert packed.state_dict().keys() == plain.state_dict().keys()
    for key, value in packed.state_dict().items():
        assert torch.equal(value, plain.state_dict()[key]), key
    # Decode-sized and prefill-sized batches both match.
    for length in (5, PACKED_MAX_ROWS + 20):
        ids = torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(length))
        torch.testing.assert_close(logits_of(packed, ids), logits_of(plain, ids), rtol=1e-5, atol=1e-5)


def test_bf16_weights_are_packed_natively_or_as_float32_where_the_cpu_has_no_bf16_gemm(tiny_models, monkeypatch):
    # Our row-major bf16 kernel off (on a CPU where it runs, bf16 weights are not packed:
    # test_bf16_weights_stay_in_the_checkpoint_layout_where_our_bf16_kernel_runs).
    monkeypatch.setenv(cpu_bf16_gemm.SWITCH, "0")
    bf16 = load(tiny_models["llama"], dtype="bfloat16")
    plain = load(tiny_models["llama"], dtype="bfloat16", cpu_prepack_weights=False)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # AVX-512 BF16 / AMX CPUs
    for m in [*linears(bf16), bf16.lm_head]:
        assert is_packed(m) and m.quant_method.upcast == (not native) and not m.quant_method.row_major
        packed = m.quant_method.packed
        if native:  # oneDNN's bf16 GEMM on a bf16 copy in its own layout, whatever packs float32
            assert packed.kernel == "onednn" and packed.dtype == torch.bfloat16
        else:
            assert packed.kernel == upcast_gemm(default_packed_gemm()) and packed.dtype == torch.float32
        assert m.weight.dtype == torch.bfloat16  # the packed weight reads as the checkpoint's dtype
    assert not any(is_packed(m) for m in [*linears(plain), plain.lm_head])
    assert_bf16_logits_close(bf16, plain)


def assert_bf16_logits_close(model: torch.nn.Module, plain: torch.nn.Module,
                             dtype: torch.dtype = torch.bfloat16) -> None:
    for length in (1, 5, PACKED_MAX_ROWS + 20):
        ids = torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(length))
        got, expected = logits_of(model, ids), logits_of(plain, ids)
        assert got.dtype == expected.dtype == dtype
        # Both accumulate in float32; they may round the bf16 outputs of a layer differently.
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.05 * expected.float().abs().max().item())


def row_major_kernel_here(dtype: torch.dtype) -> str | None:
    """Which kernel multiplies a `dtype` weight where it was loaded on this CPU, if any."""
    if dtype == torch.bfloat16 and cpu_bf16_gemm.load() is not None:
        return "bf16"  # AVX-512 BF16
    if widens_half_weights(torch.zeros(2, 2, dtype=dtype)):
        return "avx2"  # no oneDNN GEMM for the dtype on this CPU: widened in our AVX2 kernel
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_weights_stay_in_the_checkpoint_layout_where_a_row_major_kernel_runs(tiny_models, dtype):
    kernel = row_major_kernel_here(dtype)
    if kernel is None:
        pytest.skip(f"{dtype} weights are packed on this CPU (oneDNN has a GEMM for them, or no kernel builds)")
    name = str(dtype).removeprefix("torch.")
    model = load(tiny_models["llama"], dtype=name)
    plain = load(tiny_models["llama"], dtype=name, cpu_prepack_weights=False)
    for m in [*linears(model), model.lm_head]:
        method = m.quant_method
        assert method.row_major == kernel and method.packed is None and not is_packed(m)
        assert type(m.weight) is torch.nn.Parameter and m.weight.dtype == dtype
    # Every parameter holds only its own values: no packed or float32 copy beside them.
    stored = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in model.parameters()}.values())
    assert stored == sum(p.numel() * 2 for p in plain.parameters())
    assert_bf16_logits_close(model, plain, dtype)


def test_float16_weights_read_in_place_leave_large_batches_to_onednn_where_it_has_an_fp16_gemm(tiny_models,
                                                                                             monkeypatch):
    """Where oneDNN has no FP16 GEMM our widening kernel takes every row count; where it has
    one (AVX512-FP16), up to NATIVE_HALF_MAX_ROWS rows, and F.linear more."""
    if row_major_kernel_here(torch.float16) != "avx2":
        pytest.skip("float16 weights are packed on this CPU (no kernel builds)")
    limit = half_linear_rows(torch.float16)
    assert limit == (None if lacks_native_gemm(torch.zeros(2, 2, dtype=torch.float16)) else NATIVE_HALF_MAX_ROWS)
    model = load(tiny_models["llama"], dtype="float16")
    layer = linears(model)[0]
    calls: list[str] = []
    real_half, real_linear = cpu_sgemm.linear_half, F.linear
    monkeypatch.setattr(cpu_sgemm, "linear_half", lambda *a: calls.append("ours") or real_half(*a))
    monkeypatch.setattr(F, "linear", lambda *a: calls.append("F.linear") or real_linear(*a))
    for rows in (1, NATIVE_HALF_MAX_ROWS, NATIVE_HALF_MAX_ROWS + 1):
        calls.clear()
        x = torch.randn(rows, layer.weight.shape[1]).half()
        got = layer.quant_method.apply(layer, x)
        assert calls == ["F.linear" if limit is not None and rows > limit else "ours"], rows
        torch.testing.assert_close(got.float(), x.float() @ layer.weight.float().t(), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(row_major_kernel_here(torch.bfloat16) is None or sys.platform != "linux",
                    reason="bf16 weights are packed on this CPU; or no Linux /proc")
def test_loading_a_bf16_model_read_in_place_grows_memory_by_at_most_its_weights(tmp_path):
    """Resident memory, not just parameter bytes: no float32 copy is made along the way."""
    from tests.conftest import REPO
    from tests.test_cpu_packing_in_place import _RSS_SCRIPT

    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=3, dtype="bfloat16", hidden_size=512,
                                intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=2, vocab_size=2048, with_tokenizer=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               MALLOC_MMAP_THRESHOLD_="131072")
    env.pop(cpu_bf16_gemm.SWITCH, None)
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(model_dir)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The float32 copy made it 2.1-2.2x; read in place, 0.6x (pages of the mapped file are
    # shared with the page cache and counted once the weights are read).
    assert result["growth"] <= 1.15 * result["weights"], result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_packed_linear_matches_f_linear_where_the_cpu_has_the_gemm(dtype):
    """oneDNN's packed bf16/fp16 product is F.linear's to the last bit but one (both
    accumulate in float32 and round the output once) for every row count, with bias."""
    supported = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}[dtype]()
    if not (packing_available("onednn") and supported):
        pytest.skip(f"this CPU has no oneDNN {dtype} GEMM (needs AVX-512 BF16/FP16 or AMX)")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(320, 128, generator=gen).to(dtype)
    assert native_half_gemm(weight) and not native_half_gemm(weight.float())
    bias = torch.randn(320, generator=gen).to(dtype)
    packed = PackedWeight(weight, "onednn")
    assert packed.verify(weight)
    eps = torch.finfo(dtype).eps
    for rows in [1, 2, 7, 31, 32, 33, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 300]:
        x = torch.randn(rows, 128, generator=gen).to(dtype)
        for b in (None, bias):
            got, expected = packed.linear(x, weight, b), F.linear(x, weight, b)
            assert got.dtype == dtype and got.shape == expected.shape
            torch.testing.assert_close(got.float(), expected.float(), rtol=2 * eps, atol=2 * eps * expected.abs().max().item())
    # A float32 input is not this copy's: the plain product serves it.
    x = torch.randn(4, 128, generator=gen)
    assert torch.equal(packed.linear(x, weight.float()), F.linear(x, weight.float()))


@pytest.mark.parametrize("kernel", ["onednn", "avx2"])
def test_weights_packed_through_the_shared_upcast_buffer_keep_their_own_values(kernel):
    """Inside reusing_upcast_buffer every weight is converted into one float32 buffer; each
    packed copy must own its values, not alias that buffer, which the next weight
    overwrites (a shape already verified is not checked again)."""
    if not packing_available(kernel):
        pytest.skip(f"{kernel} packing is not available here")
    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(48, 64, generator=generator).to(torch.bfloat16) for _ in range(3)]
    weights.append(torch.randn(96, 64, generator=generator).to(torch.bfloat16))  # grows the buffer
    with reusing_upcast_buffer():
        packed = [PackedWeight(upcast_float32(w), kernel) for w in weights]
    x = torch.randn(5, 64, generator=generator)
    for w, p in zip(weights, packed):
        torch.testing.assert_close(p.linear_any_rows(x), F.linear(x, w.float()), rtol=1e-5, atol=1e-5)
    first, second = upcast_float32(weights[0]), upcast_float32(weights[1])  # outside: a new tensor each
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, weights[0].float())


def test_fp8_linears_are_not_packed_but_the_float32_lm_head_is(tiny_models):
    fp8 = load(tiny_models["llama"], quantization="fp8")
    assert all(isinstance(m.quant_method, Fp8LinearMethod) for m in linears(fp8))
    assert is_packed(fp8.lm_head)  # the LM head stays float32


def test_weights_changed_after_loading_need_a_repack(tiny_models):
    model = load(tiny_models["llama"])
    reference = load(tiny_models["llama"], cpu_prepack_weights=False)
    ids = torch.arange(4, 12)
    for m in (model, reference):
        for linear in linears(m):
            linear.weight.data.mul_(0.5)
    assert prepack_cpu_weights(model) == len(linears(model)) + 1  # every linear and the LM head
    torch.testing.assert_close(logits_of(model, ids), logits_of(reference, ids), rtol=1e-5, atol=1e-5)


def test_onednn_prefill_rows_are_bucketed_and_the_cache_is_bounded():
    """Prefill-sized products run padded to a multiple of 64 rows (one oneDNN primitive per
    bucket, not per chunk size) and still return exactly the rows asked for; the primitive
    caches are capped unless the user set them (they grew a server's ranks to ~1 GB)."""
    if not packing_available("onednn"):
        pytest.skip("oneDNN packing is not available in this torch build")
    assert [onednn_rows(r) for r in (1, 7, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 128, 129, 2048)] == \
        [1, 7, PACKED_MAX_ROWS, 128, 128, 192, 2048]
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] and os.environ["LRU_CACHE_CAPACITY"]
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    packed = PackedWeight(weight, "onednn")
    for rows in (97, 129, 300):
        x = torch.randn(rows, 64, generator=gen)
        got = packed.linear_any_rows(x)
        assert got.shape == (rows, 96)
        torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-3)


def test_a_weight_the_library_cannot_pack_keeps_the_plain_product(monkeypatch, caplog):
    """A packing library that refuses a dtype (a build without its reorder) must leave the
    layer on F.linear with a warning, not fail the load."""
    import models.layers.unquantized as unquantized

    def refuse(self, weight, kernel):
        raise RuntimeError("no reorder for this dtype")

    monkeypatch.setattr(unquantized.PackedWeight, "__init__", refuse)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(32, 16), requires_grad=False)
    method = CPUUnquantizedLinearMethod(default_packed_gemm())
    with caplog.at_level("WARNING"):
        method.process_weights_after_loading(layer)
    assert method.packed is None and "cannot pack" in caplog.text
    x = torch.randn(3, 16)
    assert torch.equal(method.apply(layer, x), F.linear(x, layer.weight))
