"""Sliding-window attention and the logit soft cap in every attention backend.

A query at position p sees the keys at positions p - window < position <= p; a soft cap
c turns scores s into c * tanh(s / c) before the softmax. Each backend (CPU_ATTN with
and without its C decode kernel, TORCH_SDPA, TRITON_ATTN as a cross-check) must equal
the float64 reference of tests/test_triton_attn.py for windows of 1, 5 and 16 over
contexts of 40-70 tokens with block sizes 16 and 12: pure decode batches, steps mixing
decode with chunked prefill, whole prompts, and decode batches that continue step after
step across the window (the CPU backend's decode contexts). CPU_ATTN's C kernel, which
takes windows and soft caps itself, is checked also at head sizes 64 and 128 (its
AVX-512 path) in float32 and bfloat16. So must the no-metadata path
(`Attention.forward` without metadata: the profile run, `model(input_ids, positions)`),
also when its queries are split into blocks. End to end, a tiny Mistral with a window of
8 must generate transformers' greedy tokens and logprobs for prompts longer than the
window, at TP 1 and 2 (tests/sliding_window_helpers.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from config import ConfigError, SamplingParams
from config.model import ModelConfig
from engine.core import EngineCore
from models.layers.attention import Attention, get_attn_backend
from models.layers.attention import masked_attention
from models.layers.attention.backends.cpu_attn import CPUAttentionBackend
from tests.sliding_window_helpers import hf_with_window, tiny_mistral, tiny_qwen2
from tests.test_generation import engine_config, hf_greedy, make_prompts
from tests.test_triton_attn import needs_interpreter, paged_step, reference

WINDOWS = [None, 1, 5, 16]
SOFT_CAP = 1.5  # random q, k of unit variance: scores of a few units, well into tanh's bend
# (num_heads, num_kv_heads, head_size, block_size)
LAYOUTS = {"gqa2-d32-bs16": (4, 2, 32, 16), "mqa3-d16-bs12": (3, 1, 16, 12)}
# Head sizes 64 and 128: the CPU kernel's AVX-512 path, where the CPU has it.
KERNEL_LAYOUTS = {"gqa4-d64-bs12": (8, 2, 64, 12), "gqa2-d128-bs16": (4, 2, 128, 16)}
# (seq_len, query_len) per sequence.
STEPS = {
    "decode": [(40, 1), (57, 1), (70, 1), (16, 1), (63, 1)],
    "mixed": [(40, 1), (66, 20), (45, 9), (63, 1)],
    "prompts": [(41, 41), (70, 70), (2, 2)],
}
BACKENDS = ["CPU_ATTN", "CPU_ATTN-torch", "TORCH_SDPA"]


def make_backend(name: str) -> Any:
    if name == "CPU_ATTN-torch":  # the torch path the CPU backend takes without its kernel
        return CPUAttentionBackend(1, paged_decode=False)
    return get_attn_backend(name, 1)


def run_step(backend_name: str, step: Any, window: int | None, soft_cap: float | None) -> tuple[torch.Tensor, ...]:
    num_heads, num_kv_heads, head_size = step.q.shape[1], step.k.shape[1], step.q.shape[2]
    layer = Attention(num_heads, head_size, head_size**-0.5, num_kv_heads, sliding_window=window,
                      logits_soft_cap=soft_cap)
    backend = make_backend(backend_name)
    cache = step.cache.clone()
    layer.bind_kv_cache(cache, backend.make_impl(layer))
    common = dataclasses.replace(step.common, req_ids=tuple(f"r{i}" for i in range(len(step.seqs))))
    out = layer.impl.forward(step.q.clone(), step.k.clone(), step.v.clone(), cache, backend.build_metadata(common))
    return out, cache


def check_step(backend_name: str, step: Any, window: int | None, soft_cap: float | None) -> None:
    out, cache = run_step(backend_name, step, window, soft_cap)
    expected, expected_cache = reference(step, step.q.shape[2] ** -0.5, window, soft_cap)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=0)
    assert torch.equal(cache.cpu(), expected_cache)


def test_reference_is_not_vacuous() -> None:
    """Each window and the soft cap change the reference's output on these steps."""
    for kind, seqs in STEPS.items():
        step = paged_step(seqs, *LAYOUTS["gqa2-d32-bs16"], seed=3)
        full = reference(step, 32**-0.5)[0]
        for window in WINDOWS[1:]:
            assert not torch.allclose(reference(step, 32**-0.5, window)[0], full, atol=1e-3), (kind, window)
        assert not torch.allclose(reference(step, 32**-0.5, None, SOFT_CAP)[0], full, atol=1e-3), kind


@pytest.mark.parametrize("soft_cap", [None, SOFT_CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference(backend: str, layout: str, window: int | None, soft_cap: float | None) -> None:
    for seed, kind in enumerate(STEPS):
        check_step(backend, paged_step(STEPS[kind], *LAYOUTS[layout], seed=seed, device="cpu"), window, soft_cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (1, None), (5, SOFT_CAP), (16, None), (None, SOFT_CAP)])
@pytest.mark.parametrize("layout", list(KERNEL_LAYOUTS))
def test_cpu_kernel_head_sizes(layout: str, window: int | None, soft_cap: float | None, dtype: torch.dtype) -> None:
    """CPU_ATTN's kernel at the head sizes its vectorised path takes, float32 and bfloat16."""
    for seed, kind in enumerate(STEPS):
        step = paged_step(STEPS[kind], *KERNEL_LAYOUTS[layout], dtype=dtype, seed=seed, device="cpu")
        out, cache = run_step("CPU_ATTN", step, window, soft_cap)
        expected, expected_cache = reference(step, step.q.shape[2] ** -0.5, window, soft_cap)
        torch.testing.assert_close(out.double(), expected, atol=2e-5 if dtype == torch.float32 else 3e-2, rtol=0)
        assert torch.equal(cache, expected_cache)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, SOFT_CAP), (16, None), (None, SOFT_CAP)])
def test_torch_sdpa_on_cuda(window: int | None, soft_cap: float | None) -> None:
    """TORCH_SDPA where CUDA takes it (masked SDPA kernels, GQA), and the no-metadata path."""
    for seed, seqs in enumerate(STEPS.values()):
        check_step("TORCH_SDPA", paged_step(seqs, *LAYOUTS["gqa2-d32-bs16"], seed=seed, device="cuda"), window,
                   soft_cap)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(67, h, 32, generator=gen) for h in (4, 2, 2))
    layer = Attention(4, 32, 32**-0.5, 2, sliding_window=window, logits_soft_cap=soft_cap)
    out = layer(q.reshape(67, -1).cuda(), k.reshape(67, -1).cuda(), v.reshape(67, -1).cuda()).view(67, 4, 32)
    torch.testing.assert_close(out.cpu().double(), dense_reference(q, k, v, window, soft_cap), atol=2e-5, rtol=0)


@needs_interpreter
@pytest.mark.parametrize("window,soft_cap", [(5, SOFT_CAP), (16, None)])
def test_triton_matches_the_same_reference(window: int, soft_cap: float | None) -> None:
    """TRITON_ATTN (interpreted) on the same steps: the backends agree on the semantics."""
    check_step("TRITON_ATTN", paged_step(STEPS["mixed"], *LAYOUTS["mqa3-d16-bs12"], seed=1, device="cpu"),
               window, soft_cap)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,soft_cap", [(16, None), (5, SOFT_CAP), (None, SOFT_CAP)])
def test_decode_steps_across_the_window(backend: str, window: int | None, soft_cap: float | None) -> None:
    """One batch decoding step after step from contexts inside the window to past it
    (the CPU backend's decode contexts and kernel serve the first steps, the masked
    path the later ones) equals the reference at every step."""
    num_heads, num_kv_heads, head_size, block_size = LAYOUTS["gqa2-d32-bs16"]
    layer = Attention(num_heads, head_size, head_size**-0.5, num_kv_heads, sliding_window=window,
                      logits_soft_cap=soft_cap)
    backend_obj = make_backend(backend)
    start_lens = [12, 14, 9]
    full = paged_step([(n + 8, n + 8) for n in start_lens], num_heads, num_kv_heads, head_size, block_size,
                      seed=7, device="cpu")
    cache = full.cache.clone()
    layer.bind_kv_cache(cache, backend_obj.make_impl(layer))
    qsl = full.common.query_start_loc
    for step_index in range(8):
        lens = [n + step_index + 1 for n in start_lens]
        rows = [qsl[i] + n - 1 for i, n in enumerate(lens)]  # each sequence's token at position n - 1
        seqs = [(n, 1) for n in lens]
        slots = torch.tensor([int(full.common.slot_mapping[r]) for r in rows])
        common = dataclasses.replace(full.common, slot_mapping=slots, seq_lens=lens, query_start_loc=[0, 1, 2, 3],
                                     req_ids=("a", "b", "c"))
        step = full._replace(seqs=seqs, q=full.q[rows], k=full.k[rows], v=full.v[rows], cache=cache.clone(),
                             common=common)
        expected, expected_cache = reference(step, head_size**-0.5, window, soft_cap)
        out = layer.impl.forward(step.q, step.k, step.v, cache, backend_obj.build_metadata(common))
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0, msg=f"step {step_index}")
        assert torch.equal(cache, expected_cache)


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                    soft_cap: float | None) -> torch.Tensor:
    """Causal attention of one sequence in float64: q [T, H, D], k, v [T, Hkv, D]."""
    num_tokens, group = q.shape[0], q.shape[1] // k.shape[1]
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * q.shape[2] ** -0.5
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    pos = torch.arange(num_tokens)
    visible = pos.unsqueeze(0) <= pos.unsqueeze(1)
    if window:
        visible &= pos.unsqueeze(0) > pos.unsqueeze(1) - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, values)


@pytest.mark.parametrize("budget", [None, 4096], ids=["one-call", "row-blocks"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (1, None), (5, SOFT_CAP), (16, None), (None, SOFT_CAP)])
def test_no_metadata_path(monkeypatch: pytest.MonkeyPatch, budget: int | None, window: int | None,
                          soft_cap: float | None) -> None:
    """Attention.forward without metadata (the profile run, model(input_ids, positions)),
    also with the queries split into blocks of a few rows (a tiny score budget)."""
    if budget is not None:
        monkeypatch.setattr(masked_attention, "CHUNK_SCORES_BYTES", budget)
        assert masked_attention.query_rows_per_call(4, 67, window) < 67
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(67, h, 32, generator=gen) for h in (4, 2, 2))
    layer = Attention(4, 32, 32**-0.5, 2, sliding_window=window, logits_soft_cap=soft_cap)
    out = layer(q.reshape(67, -1), k.reshape(67, -1), v.reshape(67, -1)).view(67, 4, 32)
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, window, soft_cap), atol=2e-5, rtol=0)


def test_workspace_counts_the_float32_copies_of_a_capped_layer() -> None:
    backend = get_attn_backend("TORCH_SDPA", 1)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            plain = Attention(8, 64, 0.125, 2)
            capped = Attention(8, 64, 0.125, 2, logits_soft_cap=50.0)
        finally:
            torch.set_default_dtype(torch.float32)
    context = 2 * 2 * 4096 * 64
    assert backend.workspace_bytes(capped, 4096) - backend.workspace_bytes(plain, 4096) >= context * 4
    # float32 layers compute in place: nothing more.
    assert backend.workspace_bytes(Attention(8, 64, 0.125, 2, logits_soft_cap=50.0), 4096) == \
        backend.workspace_bytes(Attention(8, 64, 0.125, 2), 4096)


# ---------------------------------------------------------------------- the config


def test_mistral_window_shorter_than_max_model_len_is_accepted(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Formerly refused; now honoured (the engine tests below check the tokens)."""
    model_dir = tiny_mistral(tmp_path_factory)
    config = engine_config(model_dir, 1, 16, attention_backend="TORCH_SDPA")
    assert config.model_config.hf_config.sliding_window == 8 < config.model_config.max_model_len


def from_hf(hf_config: Any, tmp_path: Path) -> ModelConfig:
    return ModelConfig.from_hf_config(str(tmp_path), hf_config, tmp_path / "config.json", dtype="float32",
                                      max_model_len=64, seed=0, revision=None, quantization=None)


def test_a_window_no_model_of_ours_reads_is_still_refused(tmp_path: Path) -> None:
    from types import SimpleNamespace

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=320,
                  sliding_window=8, max_position_embeddings=128)
    llama = SimpleNamespace(architectures=["LlamaForCausalLM"], **fields)
    with pytest.raises(ConfigError, match="sliding_window=8"):
        from_hf(llama, tmp_path)
    qwen = SimpleNamespace(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, **fields)
    assert from_hf(qwen, tmp_path).max_model_len == 64  # Qwen2 reads its window now
    qwen.use_sliding_window = False  # Qwen2's default: the field is there, the window is off
    assert from_hf(qwen, tmp_path).max_model_len == 64


def test_qwen2_windows_follow_use_sliding_window_and_max_window_layers() -> None:
    from types import SimpleNamespace

    from models.qwen2 import qwen_sliding_windows

    base = dict(num_hidden_layers=4, sliding_window=16)
    assert qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=False, max_window_layers=0)) == [None] * 4
    assert qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=True, max_window_layers=0)) == [16] * 4
    assert qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=True, max_window_layers=3)) == [
        None, None, None, 16]
    # transformers' default max_window_layers is 28: none of 4 layers is windowed
    assert qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=True)) == [None] * 4


# ---------------------------------------------------------------------- end to end

MAX_NEW = 8
PROMPT_LENS = (5, 19, 40, 61)  # within the window, and two to seven windows long


def test_transformers_applies_mistrals_window(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The oracle is not vacuous: transformers' Mistral logits change with the window."""
    model_dir = tiny_mistral(tmp_path_factory)
    prompt = make_prompts(320, lens=(40,))[0]
    with torch.no_grad():
        windowed = hf_with_window(model_dir, 8)(torch.tensor([prompt])).logits
        full = hf_with_window(model_dir, None)(torch.tensor([prompt])).logits
    assert torch.allclose(windowed[0, :8], full[0, :8], atol=1e-5)  # inside the window: the same
    assert (windowed[0, 8:] - full[0, 8:]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def mistral_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    model_dir = tiny_mistral(tmp_path_factory)
    hf = hf_with_window(model_dir, 8)
    return model_dir, [hf_greedy(hf, p, MAX_NEW) for p in make_prompts(320, lens=PROMPT_LENS)]


ENGINES = [("CPU_ATTN", 1, 16), ("TORCH_SDPA", 1, 12), ("CPU_ATTN", 2, 12), ("TORCH_SDPA", 2, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("backend,tp,block_size", ENGINES, ids=[f"{b}-tp{t}-bs{s}" for b, t, s in ENGINES])
def test_mistral_with_window_matches_transformers(mistral_reference: tuple[Path, list[Any]], backend: str,
                                                  tp: int, block_size: int) -> None:
    model_dir, ref = mistral_reference
    prompts = make_prompts(320, lens=PROMPT_LENS)
    check_engine_against(engine_config(model_dir, tp, block_size, attention_backend=backend), prompts, ref)


def check_engine_against(config: Any, prompts: list[list[int]], ref: list[Any]) -> None:
    """The engine's greedy tokens and top-5 logprobs equal transformers' (`ref`)."""
    with EngineCore(config) as core:
        outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                     logprobs=5))
    for prompt, out, (ref_ids, ref_lp) in zip(prompts, outs, ref):
        assert out.token_ids == ref_ids, f"prompt of {len(prompt)} tokens"
        for step, lp in enumerate(out.logprobs):
            for tok, value in lp.items():
                assert value == pytest.approx(float(ref_lp[step, tok]), abs=1e-4), (len(prompt), step, tok)


def test_transformers_applies_qwen2s_window_from_max_window_layers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The Qwen2 oracle is not vacuous either: its windowed layers change the logits."""
    model_dir = tiny_qwen2(tmp_path_factory)
    prompt = make_prompts(320, lens=(40,))[0]
    with torch.no_grad():
        windowed = hf_with_window(model_dir, 8)(torch.tensor([prompt])).logits
        full = hf_with_window(model_dir, None)(torch.tensor([prompt])).logits
    assert torch.allclose(windowed[0, :8], full[0, :8], atol=1e-5)
    assert (windowed[0, 8:] - full[0, 8:]).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_with_window_matches_transformers(tmp_path_factory: pytest.TempPathFactory, tp: int) -> None:
    """Qwen2's `use_sliding_window` with `max_window_layers`: full and windowed layers in
    one model, prompts up to seven windows long, against transformers' tokens and logprobs."""
    model_dir = tiny_qwen2(tmp_path_factory)
    prompts = make_prompts(320, lens=PROMPT_LENS)
    hf = hf_with_window(model_dir, 8)
    ref = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    check_engine_against(engine_config(model_dir, tp, 16, attention_backend="CPU_ATTN"), prompts, ref)


def test_torch_sdpa_decode_gathers_only_the_blocks_a_window_reaches() -> None:
    """A windowed layer's decode groups read from the block holding the window's first
    key, not the whole context; the outputs stay the reference's (the windowed decode
    steps above check them too)."""
    from models.layers.attention.backends.torch_sdpa import TorchSDPAMetadata

    step = paged_step(STEPS["decode"], *LAYOUTS["gqa2-d32-bs16"], seed=5)
    md = TorchSDPAMetadata.from_common(step.common)
    bytes_per_token = 2 * 2 * 32 * 4
    full = md.decode_groups(bytes_per_token, torch.device("cpu"), None)
    windowed = md.decode_groups(bytes_per_token, torch.device("cpu"), 5)
    assert max(g.ctx_len for g in full) == 80  # the 70-token context, in blocks of 16
    # A window of 5 reaches back at most into the previous block: two blocks at most.
    assert max(g.ctx_len for g in windowed) <= 2 * 16
    for window in (1, 5, 16):
        check_step("TORCH_SDPA", step, window, None)
