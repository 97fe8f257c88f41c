"""Gemma 2 and Gemma 3 (text) against transformers' eager attention (the implementation
that honours attention soft-capping).

Each checkpoint is written by transformers itself (tests/hf_checkpoints.py): 4 layers,
sliding window 8 with prompts of up to 40 tokens (chunked prefill in 32-token steps),
`query_pre_attn_scalar` 24 != head_dim 16, norm weights that are not zero (Gemma's
1 + w). Gemma 2 runs with attention and final-logit soft caps small enough to change
the logits, and without `layer_types` in its config.json (the even-layers-slide
default); Gemma 3 with a layer pattern of 3 ([S, S, F, S]) and RoPE bases 10000
(sliding) and 100 (global), also in the older config spelling (`rope_local_base_freq`,
`sliding_window_pattern`), and with the global layers' RoPE scaled linearly (factor 8,
as the released checkpoints have it). Greedy tokens, top-5 logprobs and prompt logprobs at TP 1
and 2, on the Triton backend (under its interpreter) and the CPU one.
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
from models.gemma2 import gemma_layer_types
from models.gemma3 import gemma3_rope_settings
from models.layers.activation import get_act_and_mul_fn
from tests.hf_checkpoints import assert_logprobs_match, hf_prompt_logprobs, save_random_checkpoint
from tests.test_generation import engine_config, hf_greedy, make_prompts

VOCAB = 320
WINDOW = 8
MAX_NEW = 6
LENS = (1, 9, 23, 40)  # shorter than the window, and up to five windows long
PROMPT_LOGPROB_LENS = (12, 37)
MAX_MODEL_LEN = 64


def _config(name: str) -> Any:
    import transformers

    common: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
                                  sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "gemma2":
        return transformers.Gemma2Config(**common, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    # The released Gemma 3 checkpoints scale the global layers' RoPE linearly (factor 8).
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 100.0} if name == "gemma3_linear" \
        else {"rope_type": "default", "rope_theta": 100.0}
    return transformers.Gemma3TextConfig(**common, sliding_window_pattern=3, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": full})


def _edit_config(model_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def _legacy_gemma3_keys(cfg: dict[str, Any]) -> None:
    """The same model in the spelling of transformers v4 (and of the released checkpoints)."""
    assert cfg.pop("layer_types") == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["full_attention"]["rope_theta"],
               rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=None,
               sliding_window_pattern=3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    dirs = {name: save_random_checkpoint(_config(name), root / name, seed)
            for name, seed in (("gemma2", 41), ("gemma3", 42), ("gemma3_linear", 43))}
    # Without layer_types, Gemma 2's layers alternate, the even ones sliding.
    _edit_config(dirs["gemma2"], lambda cfg: cfg.pop("layer_types"))
    dirs["gemma3_legacy"] = Path(shutil.copytree(dirs["gemma3"], root / "gemma3_legacy"))
    _edit_config(dirs["gemma3_legacy"], _legacy_gemma3_keys)
    return dirs


def _hf_eager(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    return hf


class Reference(SimpleNamespace):
    greedy: list[tuple[list[int], torch.Tensor]]  # per prompt of LENS: (ids, logprobs [MAX_NEW, vocab])
    prompt_logprobs: list[torch.Tensor]  # per prompt of PROMPT_LOGPROB_LENS


@pytest.fixture(scope="module")
def hf_reference(checkpoints: dict[str, Path]) -> Callable[[str], Reference]:
    """hf_reference("gemma2" | "gemma3") -> transformers' outputs, computed once."""
    cache: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in cache:
            hf = _hf_eager(checkpoints[name])
            cache[name] = Reference(
                greedy=[hf_greedy(hf, p, MAX_NEW) for p in make_prompts(VOCAB, lens=LENS)],
                prompt_logprobs=[hf_prompt_logprobs(hf, p) for p in make_prompts(VOCAB, 5, PROMPT_LOGPROB_LENS)])
        return cache[name]

    return get


def _check_against_transformers(core: EngineCore, ref: Reference, where: str) -> None:
    prompts = make_prompts(VOCAB, lens=LENS)
    outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))
    for prompt, out, (ref_ids, ref_lp) in zip(prompts, outs, ref.greedy):
        assert out.token_ids == ref_ids, f"{where}: prompt of {len(prompt)} tokens"
        assert out.logprobs is not None
        assert_logprobs_match(out.logprobs, ref_lp, out.token_ids, 5, f"{where}: prompt of {len(prompt)}")
    # Greedy without logprobs takes the LM head's argmax path (no gathered logits).
    greedy = core.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [ids for ids, _ in ref.greedy], where
    prompts = make_prompts(VOCAB, seed=5, lens=PROMPT_LOGPROB_LENS)
    outs = core.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))
    for prompt, out, ref_lp in zip(prompts, outs, ref.prompt_logprobs):
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert_logprobs_match(out.prompt_logprobs[1:], ref_lp, prompt[1:], 5, f"{where}: prompt of {len(prompt)}")


# (checkpoint, oracle, tp, attention backend, block size)
ENGINES = [
    ("gemma2", "gemma2", 1, "TRITON_ATTN", 4),
    ("gemma3", "gemma3", 1, "TRITON_ATTN", 16),
    ("gemma2", "gemma2", 1, "CPU_ATTN", 16),
    ("gemma3_legacy", "gemma3", 1, "CPU_ATTN", 4),
    ("gemma3_linear", "gemma3_linear", 1, "CPU_ATTN", 16),
    pytest.param("gemma2", "gemma2", 2, "TRITON_ATTN", 16, marks=pytest.mark.slow),
    pytest.param("gemma3", "gemma3", 2, "TRITON_ATTN", 4, marks=pytest.mark.slow),
    pytest.param("gemma2", "gemma2", 2, "CPU_ATTN", 4, marks=pytest.mark.slow),
    pytest.param("gemma3", "gemma3", 2, "CPU_ATTN", 16, marks=pytest.mark.slow),
    pytest.param("gemma3", "gemma3", 4, "CPU_ATTN", 16, marks=pytest.mark.slow),  # KV heads replicated
]


@pytest.mark.parametrize("name, oracle, tp, backend, block_size", ENGINES)
def test_greedy_and_logprobs_match_transformers(name: str, oracle: str, tp: int, backend: str, block_size: int,
                                                checkpoints: dict[str, Path], hf_reference: Callable) -> None:
    cfg = engine_config(checkpoints[name], tp, block_size, max_model_len=MAX_MODEL_LEN, attention_backend=backend)
    with EngineCore(cfg) as core:
        _check_against_transformers(core, hf_reference(oracle), f"{name} tp{tp} {backend}")


def test_gemma2_layers_alternate_unless_layer_types_says_otherwise() -> None:
    def config(**kw: Any) -> SimpleNamespace:
        return SimpleNamespace(num_hidden_layers=4, **kw)

    def even_slides(i: int) -> str:
        return "sliding_attention" if i % 2 == 0 else "full_attention"

    assert gemma_layer_types(config(), even_slides) == [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    listed = ["full_attention"] * 3 + ["sliding_attention"]
    assert gemma_layer_types(config(layer_types=listed), even_slides) == listed


def test_gemma3_reads_both_rope_spellings() -> None:
    v5 = SimpleNamespace(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    v4 = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    for cfg in (v5, v4):
        assert gemma3_rope_settings(cfg, "sliding_attention") == (10000.0, None)
        theta, scaling = gemma3_rope_settings(cfg, "full_attention")
        assert theta == 1e6 and scaling is not None and scaling["factor"] == 8.0


def test_unknown_layer_type_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(checkpoints["gemma3"], tmp_path / "m"))
    _edit_config(model_dir, lambda cfg: cfg.update(
        layer_types=["sliding_attention", "chunked_attention", "full_attention", "sliding_attention"]))
    with pytest.raises(ConfigError, match=r"layer_types\[1\]='chunked_attention' is not supported"):
        EngineCore(engine_config(model_dir, 1, 4, max_model_len=MAX_MODEL_LEN))
    with pytest.raises(ConfigError, match=r"layer_types=.* must list one type for each of the 4 layers"):
        gemma_layer_types(SimpleNamespace(num_hidden_layers=4, layer_types=["full_attention"]), str)


def test_unknown_hidden_activation_is_refused_naming_it(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(checkpoints["gemma2"], tmp_path / "m"))
    _edit_config(model_dir, lambda cfg: cfg.update(hidden_activation="gelu_fast"))
    with pytest.raises(ConfigError, match=r"hidden_activation='gelu_fast' is not supported"):
        EngineCore(engine_config(model_dir, 1, 4, max_model_len=MAX_MODEL_LEN))


def test_geglu_matches_transformers_activations() -> None:
    from transformers.activations import ACT2FN

    x = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0))
    for name in ("gelu_pytorch_tanh", "gelu"):
        expected = ACT2FN[name](x[:, :24]) * x[:, 24:]
        assert torch.equal(get_act_and_mul_fn("hidden_activation", name)(x.clone()), expected), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_scales_by_one_plus_the_checkpoint_weight(dtype: torch.dtype) -> None:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from models.layers.layernorm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(0)
    w, x, residual = (torch.randn(*shape, generator=gen) for shape in ((64,), (5, 64), (5, 64)))
    ref = Gemma2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(w)
    torch.set_default_dtype(dtype)  # as the model loader builds the layers
    try:
        ours = GemmaRMSNorm(64, eps=1e-6)
    finally:
        torch.set_default_dtype(torch.float32)
    ours.weight.weight_loader(ours.weight, w.to(dtype))  # a checkpoint in the model dtype
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    x, residual = x.to(dtype), residual.to(dtype)
    torch.testing.assert_close(ours(x), ref(x), **tol)
    # The fused residual add (the CPU kernel where it takes the tensors), which writes
    # the sum into its input.
    total = x + residual
    normed, summed = ours(x.clone(), residual)
    torch.testing.assert_close(normed, ref(total), **tol)
    torch.testing.assert_close(summed, total)
