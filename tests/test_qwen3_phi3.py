"""Qwen3 and Phi-3 / Phi-4-mini against transformers.

Each checkpoint is written by transformers itself (tests/hf_checkpoints.py). Qwen3 runs
with head_dim 16 != hidden 48 / 4 heads, with and without q/k/v/o biases and tied
embeddings; Phi-3 with its fused qkv_proj / gate_up_proj, partial rotary (0.75, as
Phi-4-mini) and LongRoPE in both regimes: max_model_len within
original_max_position_embeddings (short factors) and past it (long factors, prompts
longer than the original length), and with a sliding window shorter than the prompts
on the Triton backend. Greedy tokens and top-5 logprobs at TP 1, greedy tokens at TP 2,
prompt logprobs against transformers' full forward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from config import SamplingParams
from config.utils import ConfigError
from engine.core import EngineCore
from models.errors import WeightLoadError
from models.layers.rotary_embedding import RotaryEmbedding, get_rope
from models.qwen3 import qwen_sliding_windows
from tests.hf_checkpoints import (
    assert_logprobs_match,
    hf_prompt_logprobs,
    save_random_checkpoint,
)
from tests.test_generation import _hf_model, engine_config, hf_greedy, make_prompts

MAX_NEW = 8
ORIGINAL_LEN = 32  # Phi-3's original_max_position_embeddings here
SHORT_LENS = (3, 11, 20)  # + MAX_NEW <= ORIGINAL_LEN: LongRoPE's short factors
LONG_LENS = (40, 61)  # > ORIGINAL_LEN: its long factors
VOCAB = 320


def _qwen3(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    kw: dict[str, Any] = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                              tie_word_embeddings=False)
    return Qwen3Config(**{**kw, **overrides})


def _phi3(**overrides: Any) -> Any:
    from transformers import Phi3Config

    gen = torch.Generator().manual_seed(0)
    rotary_half = 6  # head_dim 16 * 0.75 / 2
    longrope = {"rope_type": "longrope",
                "short_factor": (1.0 + 0.5 * torch.rand(rotary_half, generator=gen)).tolist(),
                "long_factor": (2.0 + 4.0 * torch.rand(rotary_half, generator=gen)).tolist()}
    kw: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                              original_max_position_embeddings=ORIGINAL_LEN, partial_rotary_factor=0.75,
                              rope_scaling=longrope, sliding_window=None, tie_word_embeddings=False,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Phi3Config(**{**kw, **overrides})


# name -> (config, seed)
CHECKPOINTS: dict[str, tuple[Callable[[], Any], int]] = {
    "qwen3": (lambda: _qwen3(), 31),
    "qwen3_bias_tied": (lambda: _qwen3(attention_bias=True, tie_word_embeddings=True), 32),
    "phi3_longrope": (lambda: _phi3(), 33),
    # Phi-4-mini's shape: tied embeddings, partial rotary, plain RoPE.
    "phi4_mini_tied": (lambda: _phi3(rope_scaling=None, tie_word_embeddings=True), 34),
    "phi3_window8": (lambda: _phi3(rope_scaling=None, sliding_window=8, num_hidden_layers=1), 35),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_phi3")
    return {name: save_random_checkpoint(make(), root / name, seed) for name, (make, seed) in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def hf_reference(checkpoints: dict[str, Path]) -> Callable[[str, tuple[int, ...]], list[tuple[list[int], Any]]]:
    """hf_reference(name, prompt lengths) -> per prompt: (greedy ids, logprobs [MAX_NEW, vocab])."""
    cache: dict[tuple[str, tuple[int, ...]], list[tuple[list[int], Any]]] = {}

    def get(name: str, lens: tuple[int, ...]) -> list[tuple[list[int], Any]]:
        if (name, lens) not in cache:
            hf = _hf_model(checkpoints[name])
            cache[name, lens] = [hf_greedy(hf, p, MAX_NEW) for p in make_prompts(VOCAB, lens=lens)]
        return cache[name, lens]

    return get


@pytest.fixture(scope="module")
def tp1_engine(checkpoints: dict[str, Path]) -> Any:
    """tp1_engine(name, max_model_len, **overrides) -> an in-process engine, kept for the module."""
    engines: dict[tuple, EngineCore] = {}

    def get(name: str, max_model_len: int, **overrides: Any) -> EngineCore:
        key = (name, max_model_len, tuple(sorted(overrides.items())))
        if key not in engines:
            engines[key] = EngineCore(engine_config(checkpoints[name], 1, 4, max_model_len=max_model_len,
                                                    **overrides))
        return engines[key]

    yield get
    for core in engines.values():
        core.shutdown()


def _check_greedy_and_logprobs(core: EngineCore, reference: list[tuple[list[int], Any]],
                               lens: tuple[int, ...], where: str) -> None:
    prompts = make_prompts(VOCAB, lens=lens)
    outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    for prompt, out, (ref_ids, ref_lp) in zip(prompts, outs, reference):
        assert out.token_ids == ref_ids, f"{where}: prompt of {len(prompt)} tokens"
        assert out.logprobs is not None
        assert_logprobs_match(out.logprobs, ref_lp, out.token_ids, 5, f"{where}: prompt of {len(prompt)}")


def _check_prompt_logprobs(core: EngineCore, model_dir: Path, lens: tuple[int, ...], where: str) -> None:
    prompts = make_prompts(VOCAB, seed=5, lens=lens)
    outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))
    hf = _hf_model(model_dir)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert_logprobs_match(out.prompt_logprobs[1:], hf_prompt_logprobs(hf, prompt), prompt[1:], 5,
                              f"{where}: prompt logprobs of {len(prompt)} tokens")


# ---------------------------------------------------------------------- Qwen3


@pytest.mark.parametrize("name", ["qwen3", "qwen3_bias_tied"])
def test_qwen3_greedy_and_logprobs_match_transformers(name: str, tp1_engine: Callable, hf_reference: Callable,
                                                       checkpoints: dict[str, Path]) -> None:
    cfg = json.loads((checkpoints[name] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    lens = SHORT_LENS + LONG_LENS
    _check_greedy_and_logprobs(tp1_engine(name, 128), hf_reference(name, lens), lens, name)


def test_qwen3_prompt_logprobs_match_transformers(tp1_engine: Callable, checkpoints: dict[str, Path]) -> None:
    _check_prompt_logprobs(tp1_engine("qwen3", 128), checkpoints["qwen3"], (9, 50), "qwen3")


def test_qwen3_sliding_window_layers_follow_layer_types() -> None:
    base = dict(num_hidden_layers=4, sliding_window=16, max_window_layers=2)
    assert qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=False)) == [None] * 4
    assert qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=True)) == [None, None, 16, 16]
    layer_types = ["sliding_attention", "full_attention"] * 2
    assert qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=True, layer_types=layer_types)) == [
        16, None, 16, None]
    with pytest.raises(ConfigError, match=r"layer_types\[1\]='chunked_attention'"):
        qwen_sliding_windows(SimpleNamespace(**base, use_sliding_window=True,
                                             layer_types=["full_attention", "chunked_attention"] * 2))


# ---------------------------------------------------------------------- Phi-3


def test_phi3_longrope_within_the_original_length_matches_transformers(
        tp1_engine: Callable, hf_reference: Callable) -> None:
    # max_model_len <= original_max_position_embeddings: the short factors, as transformers
    # uses for every sequence that short.
    _check_greedy_and_logprobs(tp1_engine("phi3_longrope", ORIGINAL_LEN), hf_reference("phi3_longrope", SHORT_LENS),
                               SHORT_LENS, "phi3 short factors")


def test_phi3_longrope_past_the_original_length_matches_transformers(
        tp1_engine: Callable, hf_reference: Callable, checkpoints: dict[str, Path]) -> None:
    # max_model_len > original: the long factors, as transformers uses for prompts longer
    # than the original length (and every token generated after them).
    core = tp1_engine("phi3_longrope", 128)
    _check_greedy_and_logprobs(core, hf_reference("phi3_longrope", LONG_LENS), LONG_LENS, "phi3 long factors")
    _check_prompt_logprobs(core, checkpoints["phi3_longrope"], (45,), "phi3 long factors")


def test_phi4_mini_shape_tied_partial_rotary_matches_transformers(
        tp1_engine: Callable, hf_reference: Callable) -> None:
    lens = SHORT_LENS + LONG_LENS
    _check_greedy_and_logprobs(tp1_engine("phi4_mini_tied", 128), hf_reference("phi4_mini_tied", lens), lens,
                               "phi4-mini shape")


@pytest.mark.slow
def test_phi3_sliding_window_shorter_than_the_prompts_on_triton(
        tp1_engine: Callable, hf_reference: Callable) -> None:
    lens = (11, 20)  # each longer than the window of 8
    core = tp1_engine("phi3_window8", ORIGINAL_LEN, attention_backend="TRITON_ATTN")
    _check_greedy_and_logprobs(core, hf_reference("phi3_window8", lens), lens, "phi3 window 8 (triton)")


# ---------------------------------------------------------------------- TP 2 and 4


@pytest.mark.slow
@pytest.mark.parametrize("name,max_model_len,lens,tp", [
    ("qwen3", 128, SHORT_LENS + LONG_LENS, 2),
    ("phi3_longrope", 128, LONG_LENS, 2),
    ("qwen3", 128, SHORT_LENS, 4),  # 4 heads, 2 KV heads: each KV head on two ranks
])
def test_greedy_matches_transformers_at_tp2_and_4(name: str, max_model_len: int, lens: tuple[int, ...], tp: int,
                                                  checkpoints: dict[str, Path], hf_reference: Callable) -> None:
    prompts = make_prompts(VOCAB, lens=lens)
    with EngineCore(engine_config(checkpoints[name], tp, 4, max_model_len=max_model_len)) as core:
        outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
        _check_prompt_logprobs(core, checkpoints[name], lens[:2], f"{name} tp{tp}")
    assert [out.token_ids for out in outs] == [ids for ids, _ in hf_reference(name, lens)]


# ---------------------------------------------------------------------- RoPE and bad input


@pytest.mark.parametrize("seq_len", [ORIGINAL_LEN, 3 * ORIGINAL_LEN])
def test_partial_longrope_equals_transformers_rotary(seq_len: int) -> None:
    """The cos/sin (attention factor included) and the partial rotation of
    transformers' Phi3 rotary, for a sequence within and one past the original length."""
    from transformers.models.phi3.modeling_phi3 import (
        Phi3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = _phi3()
    ours = get_rope(SimpleNamespace(**cfg.to_dict()), 16, seq_len)
    assert ours.rotary_dim == 12
    positions = torch.arange(seq_len)
    gen = torch.Generator().manual_seed(seq_len)
    q, k = torch.randn(seq_len, 4 * 16, generator=gen), torch.randn(seq_len, 2 * 16, generator=gen)
    cos, sin = Phi3RotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.view(1, seq_len, 4, 16).transpose(1, 2),
                                        k.view(1, seq_len, 2, 16).transpose(1, 2), cos, sin)
    got_q, got_k = ours(positions, q.clone(), k.clone())
    torch.testing.assert_close(got_q, ref_q.transpose(1, 2).reshape(seq_len, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k.transpose(1, 2).reshape(seq_len, -1), rtol=0, atol=1e-6)
    # The last quarter of each head passes through.
    assert torch.equal(got_k.view(seq_len, 2, 16)[..., 12:], k.view(seq_len, 2, 16)[..., 12:])


def test_unknown_rope_scaling_type_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(checkpoints["phi4_mini_tied"], tmp_path / "m"))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "wavelet", "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling type 'wavelet' is not supported"):
        EngineCore(engine_config(model_dir, 1, 4, max_model_len=64))


def test_rope_error_lists_the_supported_types() -> None:
    with pytest.raises(ConfigError, match="'default', 'linear', 'llama3', 'longrope'"):
        RotaryEmbedding(16, 8, 10000.0, {"type": "dynamic", "factor": 2.0})
    with pytest.raises(ConfigError, match=r"rope_scaling\['short_factor'\] must be a list of rotary_dim / 2 = 8"):
        RotaryEmbedding(16, 8, 10000.0, {"rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [1.0] * 8,
                                         "original_max_position_embeddings": 8, "max_position_embeddings": 16})


def test_longrope_reads_phi3_hub_configs_with_top_level_fields() -> None:
    """Phi-3's hub configs predate `rope_parameters`: `rope_scaling` {"type": "su" or
    "longrope", factors}, with the original length, theta and partial factor top level."""
    v5 = _phi3().to_dict()
    scaling = v5["rope_parameters"]
    hub = SimpleNamespace(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_theta=scaling["rope_theta"],
        original_max_position_embeddings=ORIGINAL_LEN, partial_rotary_factor=0.75,
        rope_scaling={"type": "su", "short_factor": scaling["short_factor"], "long_factor": scaling["long_factor"]})
    for max_len in (ORIGINAL_LEN, 128):
        ours, expected = get_rope(hub, 16, max_len), get_rope(SimpleNamespace(**v5), 16, max_len)
        assert torch.equal(ours.cos_cached, expected.cos_cached) and torch.equal(ours.sin_cached, expected.sin_cached)


def test_fused_phi3_tensor_of_the_wrong_size_is_refused_naming_it(checkpoints: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(checkpoints["phi4_mini_tied"], tmp_path / "m"))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_key_value_heads"] = 1  # the checkpoint's qkv_proj has (4 + 2 * 2) * 16 rows
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match=r"'model\.layers\.0\.self_attn\.qkv_proj\.weight'.*64 \+ 16 \+ 16"):
        EngineCore(engine_config(model_dir, 1, 4, max_model_len=64))
