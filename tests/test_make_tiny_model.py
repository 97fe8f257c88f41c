"""Tests for engine/tiny_model.py and its CLI (transformers is used only as an oracle here)."""
from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from engine.tiny_model import _plan_shards, make_tiny_model

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "make_tiny_model.py"
ARCHS = ["llama", "mistral", "qwen2"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
TEXT = "Hello, world! The quick brown fox jumps over 123 lazy dogs.\n\tdon't  stop"


def load_all(d: pathlib.Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def expected_names(arch: str, layers: int, tie: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tie else {"lm_head.weight"})
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if arch == "qwen2":
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
    return names


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory) -> tuple[str, pathlib.Path]:
    arch = request.param
    kw = dict(rope_scaling=LLAMA3_ROPE, head_dim=32) if arch == "llama" else {}
    return arch, make_tiny_model(tmp_path_factory.mktemp(arch), arch, dtype="bfloat16", num_shards=2, **kw)


def test_files_index_and_dtype(model_dir):
    arch, d = model_dir
    files = {p.name for p in d.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"} <= files
    assert "model.safetensors" not in files
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors = load_all(d)
    tie = arch == "qwen2"
    assert set(tensors) == set(index["weight_map"]) == expected_names(arch, 2, tie)
    assert ("lm_head.weight" in tensors) is not tie
    for name, fname in index["weight_map"].items():
        with safe_open(str(d / fname), "pt") as sf:
            assert name in sf.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    norm = tensors["model.norm.weight"].float()
    assert 0.5 < norm.mean() < 1.5 and norm.std() > 0.01
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is tie and cfg["model_type"] == arch
    assert ("head_dim" in cfg) == (arch == "llama")
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (4 * (32 if arch == "llama" else 16), 64)


def test_transformers_loads_all_weights(model_dir):
    transformers = pytest.importorskip("transformers")
    arch, d = model_dir
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    tf_logger = logging.getLogger("transformers")
    tf_logger.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, output_loading_info=True)
    finally:
        tf_logger.removeHandler(handler)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    msgs = " ".join(r.getMessage() for r in records).lower()
    assert "missing" not in msgs and "unexpected" not in msgs and "newly initialized" not in msgs, msgs
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                    "qwen2": "Qwen2ForCausalLM"}[arch]
    tensors = load_all(d)
    sd = model.state_dict()
    for name in ("model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        torch.testing.assert_close(sd[name], tensors[name].float(), rtol=0, atol=0)
    if arch == "qwen2":
        torch.testing.assert_close(sd["model.layers.0.self_attn.k_proj.bias"],
                                   tensors["model.layers.0.self_attn.k_proj.bias"].float(), rtol=0, atol=0)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        torch.testing.assert_close(sd["lm_head.weight"], tensors["lm_head.weight"].float(), rtol=0, atol=0)
    if arch == "llama":
        assert model.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert logits.shape == (1, 4, 320) and torch.isfinite(logits).all()


def test_deterministic_and_seed_dependent(tmp_path):
    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, with_tokenizer=False)
    a = load_all(make_tiny_model(tmp_path / "a", "qwen2", seed=3, num_shards=2, **kw))
    b = load_all(make_tiny_model(tmp_path / "b", "qwen2", seed=3, num_shards=3, **kw))
    c = load_all(make_tiny_model(tmp_path / "c", "qwen2", seed=4, num_shards=2, **kw))
    assert set(a) == set(b) == set(c)
    for k in a:  # identical values regardless of sharding
        assert torch.equal(a[k], b[k]), k
    assert all(not torch.equal(a[k], c[k]) for k in a)
    make_tiny_model(tmp_path / "a2", "qwen2", seed=3, num_shards=2, **kw)
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "a2" / f).read_bytes()


def test_single_shard_and_float16(tmp_path):
    make_tiny_model(tmp_path, "mistral", num_shards=3, with_tokenizer=False)  # stale files get removed
    d = make_tiny_model(tmp_path, "mistral", num_shards=1, dtype="float16", with_tokenizer=False,
                        tie_word_embeddings=True)
    assert sorted(p.name for p in d.glob("model*")) == ["model.safetensors"]
    assert not (d / "tokenizer.json").exists()
    t = load_all(d)
    assert "lm_head.weight" not in t and all(v.dtype == torch.float16 for v in t.values())
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["sliding_window"] is None and cfg["tie_word_embeddings"] is True


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("vocab_size", [250, 1000])
def test_tokenizer_roundtrip_and_transformers(tmp_path, arch, vocab_size):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    d = make_tiny_model(tmp_path, arch, vocab_size=vocab_size, num_shards=3, hidden_size=32,
                        intermediate_size=40, max_position_embeddings=256)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert raw.get_vocab_size() <= vocab_size
    ids = raw.encode(TEXT).ids
    assert ids[0] == 1 and max(ids) < vocab_size and 0 not in ids  # BOS, no <unk> for ASCII
    assert raw.decode(ids) == TEXT
    cfg = json.loads((d / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert tok.convert_ids_to_tokens([cfg["bos_token_id"], cfg["eos_token_id"]]) == ["<s>", "</s>"]
    assert tok(TEXT).input_ids == ids
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert tok.model_max_length == 256
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<s>user: hi\nassistant:"
    chat_ids = raw.encode(prompt, add_special_tokens=False).ids
    assert chat_ids[0] == 1 and chat_ids.count(1) == 1 and raw.decode(chat_ids) == "user: hi\nassistant:"
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert model.get_input_embeddings().weight.shape == (vocab_size, 32)


def test_tokenizer_too_small_vocab_raises(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, "llama", vocab_size=64)
    make_tiny_model(tmp_path, "llama", vocab_size=64, with_tokenizer=False)


def test_invalid_args(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, "gpt2")
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, "llama", dtype="int8")
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path, "llama", num_shards=1000, with_tokenizer=False)


def test_plan_shards_balanced():
    sizes = [100, 10, 10, 10, 10, 10, 10, 10, 10, 100]
    plan = _plan_shards(sizes, 3)
    assert plan == sorted(plan) and set(plan) == {0, 1, 2}
    totals = [sum(s for s, p in zip(sizes, plan) if p == k) for k in range(3)]
    assert max(totals) <= 2 * min(totals)
    assert _plan_shards([1000, 1, 1], 3) == [0, 1, 2]  # never an empty shard
    assert _plan_shards([5, 5], 1) == [0, 0]


@pytest.mark.slow
def test_cli_and_no_transformers_import(tmp_path):
    help_out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                              check=True).stdout
    for flag in ("--arch", "--hidden-size", "--intermediate-size", "--num-hidden-layers",
                 "--num-attention-heads", "--num-key-value-heads", "--head-dim", "--vocab-size",
                 "--max-position-embeddings", "--rope-theta", "--rope-scaling", "--tie-word-embeddings",
                 "--dtype", "--seed", "--num-shards", "--rms-norm-eps", "--init-std", "--no-tokenizer"):
        assert flag in help_out, flag
    code = (
        "import sys, runpy; sys.argv = [sys.argv[0]] + sys.argv[1:]; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__'); "
        "assert 'transformers' not in sys.modules"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m"), "--arch", "llama", "--dtype", "bfloat16",
         "--num-shards", "2", "--rope-scaling", json.dumps(LLAMA3_ROPE), "--tie-word-embeddings"],
        capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    path, nbytes, unit = out.split()
    assert pathlib.Path(path) == tmp_path / "m" and unit == "bytes"
    assert int(nbytes) == sum(f.stat().st_size for f in (tmp_path / "m").glob("*.safetensors"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["rope_scaling"] == LLAMA3_ROPE and cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "bfloat16"
