"""load_format="gguf": config from GGUF metadata, names, dequantisation, llama q/k un-permute, TP.

The GGUF files are written here from the tiny HF checkpoints the way llama.cpp's
convert_hf_to_gguf.py does it: names from gguf's own `TensorNameMap`, llama q/k rows
permuted (qwen2's not), 1-D tensors kept F32 and 2-D ones stored as F32 / F16 / Q8_0 /
Q4_0. The permutation and the names are written independently of the loader's code, so
a mistake in either does not cancel out.

Tolerances (float32 compute; tiny random models of hidden 64, init_std 0.1, logits of
magnitude up to ~3, which amplify weight error about 3-4x):
- F32: the loaded model equals our safetensors load to atol 1e-5 (observed: bit for bit)
  and transformers to the suite's 1e-4.
- F16/Q8_0/Q4_0: every loaded parameter equals the dequantised stored value exactly (so
  names, dequantisation and the un-permute of quantised rows are right), the logits equal
  transformers run on those same dequantised weights to 1e-4, and against the original
  float32 model they stay within the quantisation error: relative L2 error below 0.5% /
  5% / 50% (observed ≈ 0.08% / 2% / 30%), max |Δ| below 1e-2 / 0.2 for F16 / Q8_0
  (observed ≈ 3e-3 / 0.06-0.09).
"""

from __future__ import annotations

import json
import mmap
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.arg_utils import create_engine_config
from engine.tiny_model import make_tiny_model
from model_loader import UnsupportedArchitectureError, WeightLoadError, get_model
from model_loader.gguf_reader import StringArray
from model_loader.gguf_utils import (
    GGUFError,
    dequantize_q4_0,
    dequantize_q8_0,
    find_gguf_file,
    gguf_hf_config,
    open_gguf,
)
from tests.conftest import run_tp, tiny_llama_with_tokenizer
from tests.gguf_kquants import quantize as quantize_blocks
from tests.gguf_tp import gguf_tp_cases
from tests.tp_helpers import compute_logits_on_rank

Q = gguf.GGMLQuantizationType
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
NAME_MAPS = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


# ------------------------------------------------------------------ HF -> GGUF, as llama.cpp does it


def hf_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py `LlamaModel.permute`, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def read_hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def store(data: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """(array to write, raw_dtype) for one tensor; 1-D tensors stay F32 as in llama.cpp.
    K-quants come from tests/gguf_kquants.py (gguf-py cannot write them)."""
    if data.ndim == 1 or qtype == "F32":
        return data.astype(np.float32), None
    if qtype == "F16":
        return data.astype(np.float16), None
    return quantize_blocks(data, qtype), Q[qtype]


def stored_value(data: np.ndarray, qtype: str) -> torch.Tensor:
    """What a reader gets back for `data` stored as `qtype` (float32)."""
    arr, raw = store(data, qtype)
    if raw is None:
        return torch.from_numpy(arr.astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(arr, raw))


def add_model_metadata(writer: Any, name: str, cfg: dict[str, Any]) -> None:
    """The sizes, RoPE and norm settings of config.json `cfg`, as convert_hf_to_gguf.py
    writes them (a head size other than hidden / heads as key_length and value_length)."""
    n_head = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(cfg.get("num_key_value_heads", n_head))
    # (transformers 5 writes it under rope_parameters)
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32", arch: str | None = None,
               add_tokenizer: bool = False, tensor_types: dict[str, str] | None = None) -> Path:
    """The HF checkpoint as a GGUF file, every 2-D tensor stored as `qtype` unless
    `tensor_types` names its HF tensor (a Q4_K_M-style mix)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or GGUF_ARCH[cfg["architectures"][0]]
    n_layers, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    name_map = gguf.get_tensor_name_map(NAME_MAPS.get(arch, gguf.MODEL_ARCH.LLAMA), n_layers)
    writer = gguf.GGUFWriter(str(out), arch)
    add_model_metadata(writer, hf_dir.name, cfg)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if add_tokenizer:
        add_bpe_tokenizer(writer, hf_dir, cfg["vocab_size"])
    for name, tensor in read_hf_tensors(hf_dir).items():
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = hf_permute(tensor, n_head, n_head)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = hf_permute(tensor, n_head, n_kv)
        data, raw = store(tensor.float().numpy(), (tensor_types or {}).get(name, qtype))
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_bpe_tokenizer(writer: Any, hf_dir: Path, vocab_size: int) -> None:
    """The checkpoint's byte-level BPE tokenizer.json as llama.cpp's convert script stores it
    (`get_vocab_base`): tokens in id order padded to vocab_size with `[PADi]` user-defined
    tokens, added special tokens as CONTROL, merges as "a b" strings."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    specials = {a["id"]: a["content"] for a in tok["added_tokens"] if a["special"]}
    by_id.update(specials)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert merges, "the tiny tokenizer should have merges"
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token")))
    writer.add_chat_template(tok_cfg["chat_template"])


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module")
def gguf_files(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """gguf_files(model name, qtype) -> path, written once per module."""
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, qtype: str) -> Path:
        if (name, qtype) not in cache:
            cache[(name, qtype)] = write_gguf(tiny_models[name], root / f"{name}-{qtype}.gguf", qtype)
        return cache[(name, qtype)]

    return get


def load(model: Path | str, **kwargs: Any) -> torch.nn.Module:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("load_format", "gguf")
    return get_model(create_engine_config(model=str(model), device="cpu", use_tqdm_on_load=False, **kwargs))


def plain_weight(module: torch.nn.Module) -> torch.Tensor:
    """A layer's weight as values: its plain `weight`, or the float32 values of the GGUF
    blocks it holds (`dequantized_weight` of its method)."""
    if module._parameters.get("weight") is not None:
        return module.weight
    method = getattr(module, "embedding_method", None) or module.quant_method
    return method.dequantized_weight(module)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


# Logits of the quantised files against the original float32 model (see the module docstring).
QUANT_REL_TOL = {"F16": 0.005, "Q8_0": 0.05, "Q4_0": 0.5}
QUANT_ATOL = {"F16": 1e-2, "Q8_0": 0.2}


def dequantised_checkpoint(hf_dir: Path, qtype: str, out: Path, tensor_types: dict[str, str] | None = None) -> Path:
    """A copy of the HF checkpoint whose 2-D tensors hold their GGUF-stored (dequantised)
    values (`qtype`, or the type `tensor_types` gives a tensor)."""
    out = out / f"{hf_dir.name}-{qtype}-dequantised"
    out.mkdir()
    tensors = {name: stored_value(t.numpy(), (tensor_types or {}).get(name, qtype)).contiguous()
               for name, t in read_hf_tensors(hf_dir).items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    return out


def transformers_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None], position_ids=torch.arange(ids.numel())[None]).logits[0].float()


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_tied"])
def test_f32_gguf_matches_safetensors_and_transformers(name, gguf_files, tiny_models, hf_logits):
    ids, expected = hf_logits(name)
    logits = compute_logits_on_rank(load(gguf_files(name, "F32")), ids)
    ref = compute_logits_on_rank(load(tiny_models[name], load_format="auto"), ids)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_tied"])
def test_config_comes_from_gguf_metadata(name, gguf_files, tiny_models):
    path = gguf_files(name, "F32")
    hf = json.loads((tiny_models[name] / "config.json").read_text())
    config = create_engine_config(model=str(path), device="cpu")  # load_format "auto" -> "gguf" for a .gguf file
    assert config.load_format == "gguf" and config.load_config.load_format == "gguf"
    c = config.model_config.hf_config
    assert c.architectures == hf["architectures"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert getattr(c, key) == hf[key], key
    assert c.rope_theta == pytest.approx(hf["rope_theta"])
    assert c.rms_norm_eps == pytest.approx(hf["rms_norm_eps"])
    assert config.model_config.dtype == torch.float32  # an all-F32 file
    assert c.gguf_metadata["general.architecture"] == GGUF_ARCH[hf["architectures"][0]]
    assert c.gguf_metadata["general.name"] == name
    assert config.model_config.max_model_len == hf["max_position_embeddings"]


@pytest.mark.parametrize("name,qtype", [("llama", "F16"), ("llama", "Q8_0"), ("qwen2", "Q8_0"), ("llama", "Q4_0")])
def test_quantised_gguf_loads_exact_dequantised_values(name, qtype, gguf_files, tiny_models, hf_logits, tmp_path):
    model = load(gguf_files(name, qtype))
    hf = read_hf_tensors(tiny_models[name])
    # Every loaded value is exactly the dequantised stored one: names, un-permute and dequant are right.
    attn = model.model.layers[1].self_attn
    q_size, kv_size = attn.q_size, attn.kv_size
    qkv = plain_weight(attn.qkv_proj)
    expect = {
        "q": stored_value(hf["model.layers.1.self_attn.q_proj.weight"].numpy(), qtype),
        "k": stored_value(hf["model.layers.1.self_attn.k_proj.weight"].numpy(), qtype),
        "v": stored_value(hf["model.layers.1.self_attn.v_proj.weight"].numpy(), qtype),
    }
    torch.testing.assert_close(qkv[:q_size], expect["q"], atol=0, rtol=0)
    torch.testing.assert_close(qkv[q_size:q_size + kv_size], expect["k"], atol=0, rtol=0)
    torch.testing.assert_close(qkv[q_size + kv_size:], expect["v"], atol=0, rtol=0)
    torch.testing.assert_close(plain_weight(model.model.layers[0].mlp.down_proj),
                               stored_value(hf["model.layers.0.mlp.down_proj.weight"].numpy(), qtype), atol=0, rtol=0)
    torch.testing.assert_close(plain_weight(model.model.embed_tokens)[:320],
                               stored_value(hf["model.embed_tokens.weight"].numpy(), qtype), atol=0, rtol=0)
    torch.testing.assert_close(model.model.norm.weight, hf["model.norm.weight"], atol=0, rtol=0)  # 1-D: F32

    ids, expected = hf_logits(name)
    logits = compute_logits_on_rank(model, ids)
    # Exact against transformers running the same dequantised weights ...
    torch.testing.assert_close(logits, transformers_logits(dequantised_checkpoint(tiny_models[name], qtype, tmp_path), ids),
                               atol=1e-4, rtol=1e-4)
    # ... and within the quantisation error of the original model.
    assert rel_err(logits, expected) < QUANT_REL_TOL[qtype]
    if qtype != "Q4_0":
        torch.testing.assert_close(logits, expected, atol=QUANT_ATOL[qtype], rtol=0)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 written by transformers (hidden 64, 4 heads / 2 KV heads of 32: a head
    size other than hidden / heads, as Qwen3's 128 against 1024 / 16 in Qwen3-0.6B)."""
    import transformers

    from tests.hf_checkpoints import save_random_checkpoint

    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=320,
                                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2)
    out = tmp_path_factory.mktemp("qwen3") / "qwen3"
    out.mkdir()
    return save_random_checkpoint(config, out, seed=9)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3_gguf_matches_transformers(qtype, tiny_qwen3, tmp_path):
    """general.architecture "qwen3": the per-head q/k norms (attn_q_norm, attn_k_norm) and
    a head size from attention.key_length; logits against transformers on the stored
    (dequantised) values."""
    path = write_gguf(tiny_qwen3, tmp_path / f"qwen3-{qtype}.gguf", qtype)
    config = create_engine_config(model=str(path), device="cpu")
    c = config.model_config.hf_config
    assert c.architectures == ["Qwen3ForCausalLM"] and c.head_dim == 32 and c.num_attention_heads == 4
    model = load(path)
    hf = read_hf_tensors(tiny_qwen3)
    torch.testing.assert_close(model.model.layers[1].self_attn.k_norm.weight,
                               hf["model.layers.1.self_attn.k_norm.weight"], atol=0, rtol=0)
    ids = torch.randint(3, 320, (16,), generator=torch.Generator().manual_seed(4))
    reference = tiny_qwen3 if qtype == "F32" else dequantised_checkpoint(tiny_qwen3, qtype, tmp_path)
    torch.testing.assert_close(compute_logits_on_rank(model, ids), transformers_logits(reference, ids),
                               atol=1e-4, rtol=1e-4)


def test_qwen2_bias_and_f16_dtype_auto(gguf_files, tiny_models):
    """Qwen2 q/k/v biases load un-permuted; dtype "auto" of an F16 file is float16."""
    path = gguf_files("qwen2", "F16")
    config = create_engine_config(model=str(path), load_format="gguf", device="cpu", use_tqdm_on_load=False)
    assert config.model_config.dtype == torch.float16
    model = get_model(config)
    hf = read_hf_tensors(tiny_models["qwen2"])
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    ref = torch.cat([hf[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    torch.testing.assert_close(bias, ref.to(torch.float16), atol=0, rtol=0)


def _file_mappings(path: Path) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each mapping of `path` in this process (/proc/self/smaps)."""
    found: list[list[int]] = []
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = len(fields) == 6 and fields[5] == str(path)
                if inside:
                    found.append([*(int(x, 16) for x in fields[0].split("-")), 0])
            elif inside and fields[0] == "Rss:":
                found[-1][2] += int(fields[1]) * 1024
    return [tuple(m) for m in found]


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_whole_16bit_weights_are_views_of_the_file_and_the_rest_is_handed_back(gguf_files, tiny_models):
    """An F16 file loaded as float16 at TP=1: each weight a parameter takes whole in its
    dtype (o_proj, down_proj, the embedding, the LM head) is a view of the file's mapping,
    not a copy; a fused layer's shards and the un-permuted q/k rows are copies; the file's
    pages those copies read are handed back (the mapping lives on with the views); and
    the model computes what the safetensors checkpoint loaded as float16 computes."""
    path = gguf_files("llama", "F16")
    model = load(path, dtype="float16")
    params = dict(model.named_parameters())
    ours = [m for m in _file_mappings(path) if any(m[0] <= p.data_ptr() < m[1] for p in params.values())]
    assert len(ours) == 1, "the aliased weights keep this load's mapping of the file"
    start, end, rss = ours[0]
    views = {name: p for name, p in params.items() if start <= p.data_ptr() < end}
    expected = {"model.embed_tokens.weight", *(f"model.layers.{i}.{m}.weight" for i in range(2)
                                               for m in ("self_attn.o_proj", "mlp.down_proj"))}
    assert expected <= set(views) and not any("qkv_proj" in n or "gate_up_proj" in n for n in views)
    page = mmap.PAGESIZE
    assert rss <= sum(-(-p.numel() * p.element_size() // page) * page + page for p in views.values())
    hf = read_hf_tensors(tiny_models["llama"])
    for name in expected:
        assert torch.equal(views[name], hf[name].to(torch.float16)), name
    ids = torch.tensor([1, 17, 250, 3, 99, 318])
    reference = load(tiny_models["llama"], load_format="auto", dtype="float16")
    assert torch.equal(compute_logits_on_rank(model, ids), compute_logits_on_rank(reference, ids))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_the_file_pages_copies_read_are_handed_back_during_the_load(tmp_path, monkeypatch):
    """The loader hands back the pages its copies read as it goes, not once the load is
    done, so the load's peak holds the copies and a bounded share of the file, not the
    whole file besides: with a hand-back after every tensor, the file's mapping never
    holds more than its views (the weights taken whole) and about one tensor (an F16
    llama of hidden 256: its q/k/v and gate/up copies read 2.4 MB of the file, the
    largest tensor is 0.5 MB)."""
    from model_loader import gguf_loader

    path = write_gguf(make_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=1024),
                      tmp_path / "llama-F16.gguf", "F16")
    monkeypatch.setattr(gguf_loader, "RELEASE_EVERY_BYTES", 1)
    tensors = open_gguf(path).tensors
    largest = max(t.n_bytes for t in tensors)
    seen: list[tuple[int, int]] = []  # (the mapping's resident bytes, its views' bytes) at each hand-back
    release = gguf_loader.release_file_pages_outside

    def watched(mapping: torch.Tensor, keep: Any) -> int:
        keep = list(keep)
        start, end = mapping.data_ptr(), mapping.data_ptr() + mapping.numel()
        rss = sum(m[2] for m in _file_mappings(path) if m[0] <= start < m[1])
        views = sum(t.numel() * t.element_size() for t in keep if start <= t.data_ptr() < end)
        seen.append((rss, views))
        return release(mapping, keep)

    monkeypatch.setattr(gguf_loader, "release_file_pages_outside", watched)
    load(path, dtype="float16")
    assert len(seen) >= len(tensors), (len(seen), len(tensors))  # one after every tensor, and one at the end
    copied = sum(t.n_bytes for t in tensors if re.search(r"attn_[qkv]|ffn_(gate|up)", t.name))
    assert copied > 4 * largest, (copied, largest)
    # the page cache maps up to 16 pages around a faulting one (fault_around_bytes)
    slack = 64 * mmap.PAGESIZE
    for rss, views in seen:
        assert rss <= views + largest + slack, (rss, views, largest)


def test_model_dir_with_one_gguf(gguf_files, tiny_models, hf_logits, tmp_path):
    d = tmp_path / "gguf_dir"
    d.mkdir()
    (d / "model.gguf").write_bytes(gguf_files("llama", "F32").read_bytes())
    ids, expected = hf_logits("llama")
    torch.testing.assert_close(compute_logits_on_rank(load(d), ids), expected, atol=1e-4, rtol=1e-4)
    (d / "other.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="2 .gguf files"):
        create_engine_config(model=str(d), load_format="gguf", device="cpu")
    with pytest.raises(GGUFError, match="no .gguf file"):
        find_gguf_file(tiny_models["llama"])


def test_unsupported_architecture_is_named(tiny_models, tmp_path):
    path = write_gguf(tiny_models["llama"], tmp_path / "phi.gguf", "F32", arch="phi3")
    with pytest.raises(UnsupportedArchitectureError) as e:
        create_engine_config(model=str(path), load_format="gguf", device="cpu")
    msg = str(e.value)
    assert "'phi3'" in msg and "llama" in msg and "qwen2" in msg


def test_rope_freqs_tensor_is_refused(tiny_models, tmp_path):
    """llama3-style GGUFs carry rope_freqs; loading them silently with plain RoPE would be wrong."""
    out = tmp_path / "l3.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for key, value in (("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 128),
                       ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.add_tensor("rope_freqs.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="rope_freqs"):
        gguf_hf_config(out)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_fallback_dequantisers_match_gguf(qtype):
    data = (torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.3).numpy()
    packed = gguf.quants.quantize(data, Q[qtype])
    ours = (dequantize_q8_0 if qtype == "Q8_0" else dequantize_q4_0)(packed, data.shape)
    torch.testing.assert_close(ours, torch.from_numpy(gguf.quants.dequantize(packed, Q[qtype])), atol=0, rtol=0)


@pytest.mark.slow
def test_gguf_tp2(gguf_files, hf_logits):
    """TP=2 in real gloo processes: F32 llama and qwen2 exact against TP=1 / transformers, Q8_0 llama
    identical to the TP=1 Q8_0 load (the dequantised tensor is only sliced)."""
    cases = []
    for name, qtype in (("llama", "F32"), ("qwen2", "F32"), ("llama", "Q8_0")):
        ids, _ = hf_logits(name)
        cases.append({"name": f"{name}-{qtype}", "model": str(gguf_files(name, qtype)), "input_ids": ids,
                      "kwargs": {"load_format": "gguf"}})
    results = run_tp(gguf_tp_cases, 2, cases)
    for case in cases:
        name = case["name"].split("-")[0]
        _, expected = hf_logits(name)
        for res in results:
            got = res[case["name"]]
            assert got["num_heads"] == 2 and got["num_kv_heads"] == 1, case["name"]
            if case["name"].endswith("F32"):
                torch.testing.assert_close(got["logits"], expected, atol=1e-4, rtol=1e-4)
            else:
                tp1 = compute_logits_on_rank(load(case["model"]), case["input_ids"])
                torch.testing.assert_close(got["logits"], tp1, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ tokenizer from GGUF metadata

TOKENIZER_TEXTS = [
    "Hello, world!",
    "This is a test of the tokenizer: numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "  leading spaces\tand tabs\nand newlines  ",
    "The quick brown fox jumps over the lazy dog's back; it's 42.",
    "a",
]


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint WITH its byte-level BPE tokenizer.json (the session ones have none)."""
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("hf_tok") / "llama", vocab_size=320)


@pytest.fixture(scope="module")
def gguf_with_tokenizer(llama_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """That checkpoint as an F32 GGUF with the tokenizer embedded, alone in its directory."""
    d = tmp_path_factory.mktemp("gguf_tok")
    path = write_gguf(llama_with_tokenizer, d / "llama-tok.gguf", "F32", add_tokenizer=True)
    assert not (d / "tokenizer.json").exists()
    return path


def test_tokenizer_from_gguf_matches_tokenizer_json(gguf_with_tokenizer, llama_with_tokenizer):
    import tokenizers

    from engine.tokenizer import Tokenizer, load_tokenizer

    model_dir = llama_with_tokenizer
    ref = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ref_wrapped = Tokenizer.from_dir(model_dir)
    tok = Tokenizer.from_gguf(gguf_with_tokenizer)
    assert tok is not None
    for text in TOKENIZER_TEXTS:
        for special in (True, False):
            expected = ref.encode(text, add_special_tokens=special).ids
            assert tok.encode(text, add_special_tokens=special) == expected, (text, special)
        ids = tok.encode(text)
        assert ids[0] == ref_wrapped.bos_token_id  # add_bos_token=True -> the post-processor adds BOS
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (ref_wrapped.bos_token_id, ref_wrapped.eos_token_id)
    assert (tok.bos_token, tok.eos_token) == (ref_wrapped.bos_token, ref_wrapped.eos_token)
    assert tok.eos_token_ids == [ref_wrapped.eos_token_id]
    assert tok.token_to_id("</s>") == ref.token_to_id("</s>")
    assert tok.encode("</s>", add_special_tokens=False) == ref.encode("</s>", add_special_tokens=False).ids
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref_wrapped.apply_chat_template(messages)
    # The directory form and the load_format="gguf" fallback find the same tokenizer.
    for model in (gguf_with_tokenizer, gguf_with_tokenizer.parent):
        fallback = load_tokenizer(model, "gguf")
        assert fallback is not None and fallback.encode(TOKENIZER_TEXTS[0]) == ref.encode(TOKENIZER_TEXTS[0]).ids


def _gguf_py_value(field: Any) -> Any:
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def _ours_as_plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    return list(value) if isinstance(value, StringArray) else value


def test_open_gguf_reads_what_gguf_py_reads(gguf_with_tokenizer):
    """open_gguf's header reader (model_loader/gguf_reader.py) reads every key/value and
    tensor as gguf-py's own reader does: the values equal, the string arrays (the
    tokenizer's tokens and merges) decoded on access, numeric arrays read-only views; the
    tensors the same gguf-py ReaderTensors over views of the file's mapping, writable only
    copy-on-write, outliving the reader."""
    ref = gguf.GGUFReader(gguf_with_tokenizer, "r")
    reader = open_gguf(gguf_with_tokenizer, "r")
    assert list(reader.metadata) == [k for k in ref.fields if not k.startswith("GGUF.")]
    tokens = reader.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) > 100
    assert tokens[5] == ref.fields["tokenizer.ggml.tokens"].contents(5) and tokens[-1] == list(tokens)[-1]
    assert tokens[3:7] == list(tokens)[3:7]
    for name, value in reader.metadata.items():
        assert _ours_as_plain(value) == _gguf_py_value(ref.fields[name]), name
        assert type(_ours_as_plain(value)) is type(_gguf_py_value(ref.fields[name])), name
    types = reader.metadata["tokenizer.ggml.token_type"]
    assert isinstance(types, np.ndarray) and not types.flags.writeable
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.n_elements, t.n_bytes, t.data_offset) for t in reader.tensors] \
        == [(t.name, t.tensor_type, t.shape.tolist(), t.n_elements, t.n_bytes, t.data_offset) for t in ref.tensors]
    for mine, theirs in zip(reader.tensors, ref.tensors):
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data), mine.name
        assert isinstance(mine.data.base, np.memmap) or isinstance(mine.data.base.base, np.memmap)
    assert not reader.tensors[0].data.flags.writeable
    cow = open_gguf(gguf_with_tokenizer)  # copy-on-write: writable, and the file unchanged
    data = cow.tensors[0].data
    expected = np.array(data)
    del cow, reader
    data[...] = 0
    assert np.array_equal(gguf.GGUFReader(gguf_with_tokenizer, "r").tensors[0].data, expected)
    with pytest.raises(WeightLoadError, match="is not a readable GGUF file"):
        open_gguf(gguf_with_tokenizer.parent / "missing.gguf")


def test_gguf_header_reader_value_types_and_bad_files(tmp_path):
    """Every GGUF value type (scalars, strings, arrays of each, an array of arrays) and a
    quantised tensor read as gguf-py reads them; a file that is not GGUF, a truncated
    header, a tensor past the end of the file, an unsupported version and a big-endian
    file are WeightLoadErrors naming the file and what is wrong."""
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {"u8": (7, gguf.GGUFValueType.UINT8), "i8": (-7, gguf.GGUFValueType.INT8),
              "u16": (65000, gguf.GGUFValueType.UINT16), "i16": (-300, gguf.GGUFValueType.INT16),
              "u32": (4_000_000_000, gguf.GGUFValueType.UINT32), "i32": (-5, gguf.GGUFValueType.INT32),
              "f32": (0.1, gguf.GGUFValueType.FLOAT32), "b": (True, gguf.GGUFValueType.BOOL),
              "u64": (2**40, gguf.GGUFValueType.UINT64), "i64": (-(2**40), gguf.GGUFValueType.INT64),
              "f64": (0.1, gguf.GGUFValueType.FLOAT64), "s": ("héllo", gguf.GGUFValueType.STRING),
              "empty": ("", gguf.GGUFValueType.STRING)}
    for key, (value, vtype) in values.items():
        writer.add_key_value(f"t.{key}", value, vtype)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strings", ["a", "", "ü c"])
    writer.add_array("t.nested", [[1, 2], [3]])
    blocks, raw = store(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), "Q8_0")
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=raw)
    writer.add_tensor("token_embd.weight", np.arange(6, dtype=np.float16).reshape(3, 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref, ours = gguf.GGUFReader(path, "r"), open_gguf(path, "r")
    for key in [k for k in ref.fields if not k.startswith("GGUF.") and k != "t.nested"]:
        assert _ours_as_plain(ours.metadata[key]) == _gguf_py_value(ref.fields[key]), key
    # (gguf-py flattens an array of arrays: [1, 2, 3])
    assert [v.tolist() for v in ours.metadata["t.nested"]] == [[1, 2], [3]]
    assert ours.metadata["t.s"] == "héllo" and ours.metadata["t.u32"] == 4_000_000_000
    assert ours.metadata["t.f32"] == np.float32(0.1) and ours.metadata["t.f64"] == 0.1
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data.shape) == (theirs.name, theirs.tensor_type, theirs.data.shape)
        assert np.array_equal(mine.data, theirs.data)
    raw = path.read_bytes()
    header_end = ours.data_offset
    del ours

    def refused(data: bytes, match: str) -> None:
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(data)
        with pytest.raises(WeightLoadError, match=f"{re.escape(str(bad))} is not a readable GGUF file: .*{match}"):
            open_gguf(bad, "r")

    refused(b"GGML" + raw[4:], "not a GGUF file")
    refused(raw[:4] + (1).to_bytes(4, "little") + raw[8:], "GGUF version 1 is not supported")
    refused(raw[:4] + (3).to_bytes(4, "big") + raw[8:], "big-endian")
    refused(raw[:200], "truncated")
    refused(raw[:header_end + 10], "runs past the end of the file")


def test_tokenizer_from_gguf_absent_or_unsupported(gguf_files, llama_with_tokenizer, tmp_path, caplog):
    from engine.tokenizer import Tokenizer, load_tokenizer

    plain = gguf_files("llama", "F32")  # written without tokenizer metadata
    assert Tokenizer.from_gguf(plain) is None
    # A tokenizer.json beside the GGUF file wins over the GGUF's metadata.
    d = tmp_path / "with_json"
    d.mkdir()
    (d / "model.gguf").write_bytes(plain.read_bytes())
    (d / "tokenizer.json").write_text((llama_with_tokenizer / "tokenizer.json").read_text())
    assert load_tokenizer(d / "model.gguf", "gguf") is not None
    # SentencePiece ("llama") tokenizers are not rebuilt: None and a warning naming the type.
    spm = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(spm), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "\u2581a"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0])
    w.add_token_types([2, 3, 3, 1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with caplog.at_level("WARNING", logger="engine.tokenizer"):
        assert Tokenizer.from_gguf(spm) is None
    assert "'llama'" in caplog.text and "not supported" in caplog.text


def test_engine_core_uses_gguf_tokenizer(gguf_with_tokenizer):
    from config import SamplingParams
    from engine.core import EngineCore

    core = EngineCore(model=str(gguf_with_tokenizer), load_format="gguf", device="cpu", dtype="float32",
                      kv_cache_memory_bytes=1 << 22, max_model_len=128, use_tqdm_on_load=False)
    try:
        assert core.tokenizer is not None
        prompt = "Hello, world! This is a test"
        (out,) = core.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert out.prompt_token_ids == core.tokenizer.encode(prompt)
        assert len(out.token_ids) == 8
        assert out.text == core.tokenizer.decode(out.token_ids)
    finally:
        core.shutdown()
