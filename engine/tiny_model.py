"""Write small, random, HF-format causal-LM checkpoints (llama / mistral / qwen2).

The output directory gets ``config.json``, ``generation_config.json``, safetensors
weights (sharded with ``model.safetensors.index.json`` when ``num_shards > 1``) and,
optionally, a ``tokenizers``-built ``tokenizer.json`` + ``tokenizer_config.json``.
Transformers is never imported. Weights are generated shard by shard, so peak memory
is roughly one shard (plus one float32 tensor) even for GB-sized checkpoints.

Used by the demo model of ``python -m engine.serve``, the tests and the benchmarks;
``python scripts/make_tiny_model.py OUT_DIR --arch llama`` is its command line.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3 in every tokenizer built here
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
CHAT_TEMPLATE = (  # renders BOS itself: encode rendered prompts with add_special_tokens=False
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
QWEN2_PRETOKENIZE_REGEX = (  # same as transformers' Qwen2Tokenizer
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CORPUS = """The quick brown fox jumps over the lazy dog. A tiny language model is useful for tests.
Once upon a time there was a small village near the river, and the people who lived there
were kind and curious. Every morning the children walked to school, and every evening they
told stories about the stars, the moon, the sun and the sea. What is the capital of France?
The capital of France is Paris. How many days are in a week? There are seven days in a week.
Hello, world! This is a test of the tokenizer: numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.
def main():\n    print("hello")\n    return 0\nimport os, sys; x = [i * 2 for i in range(10)]
User: Can you help me? Assistant: Of course, I would be happy to help you with that question.
"""


def build_tokenizer(vocab_size: int, qwen_style: bool = False) -> Tokenizer:
    """Build a deterministic byte-level BPE tokenizer with at most ``vocab_size`` tokens.

    If all 256 bytes fit, BPE is trained on the built-in ``CORPUS`` (vocab capped at 4096).
    Otherwise the vocab is only the byte-level symbols of printable ASCII, newline and tab
    (no merges; other bytes become ``<unk>``). ``qwen_style`` uses the Qwen2 pre-tokenizer
    regex and NFC normalizer: transformers v5 always loads ``qwen2`` checkpoints with
    ``Qwen2Tokenizer``, which imposes those, so this keeps both tokenizations identical.
    ``SPECIAL_TOKENS`` get ids 0..3 and BOS is prepended on encode.
    """
    full_bytes = vocab_size >= 256 + len(SPECIAL_TOKENS)
    if full_bytes:
        tok = Tokenizer(models.BPE())
    else:
        text = "\t\n" + "".join(chr(c) for c in range(32, 127))  # bytes -> byte-level symbols
        symbols = list(pre_tokenizers.ByteLevel(use_regex=False).pre_tokenize_str(text)[0][0])
        if vocab_size < len(SPECIAL_TOKENS) + len(symbols):
            raise ValueError(f"vocab_size={vocab_size} too small for a tokenizer; use with_tokenizer=False")
        vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + symbols)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not qwen_style)
    if qwen_style:
        tok.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    if full_bytes:
        trainer = trainers.BpeTrainer(
            vocab_size=min(vocab_size, 4096), special_tokens=SPECIAL_TOKENS, min_frequency=2,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    else:
        tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.get_vocab_size() <= vocab_size
    return tok


def _weight_shapes(arch: str, h: int, inter: int, layers: int, heads: int, kv_heads: int,
                   head_dim: int, vocab: int, tie: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Ordered (name, shape) list of every tensor in the checkpoint."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        attn = [("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)]
        for name, out in attn:
            shapes.append((f"{p}self_attn.{name}.weight", (out, h)))
            if arch == "qwen2":
                shapes.append((f"{p}self_attn.{name}.bias", (out,)))
        shapes.append((f"{p}self_attn.o_proj.weight", (h, heads * head_dim)))
        shapes += [(f"{p}mlp.gate_proj.weight", (inter, h)), (f"{p}mlp.up_proj.weight", (inter, h)),
                   (f"{p}mlp.down_proj.weight", (h, inter))]
        shapes += [(f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    if not tie:
        shapes.append(("lm_head.weight", (vocab, h)))
    return shapes


def _plan_shards(sizes: list[int], num_shards: int) -> list[int]:
    """Split tensor byte sizes (kept in order, kept whole) into ``num_shards`` non-empty
    contiguous groups of roughly equal size; returns the shard index of every tensor."""
    if not 1 <= num_shards <= len(sizes):
        raise ValueError(f"num_shards must be in [1, {len(sizes)}], got {num_shards}")
    plan, idx = [], 0
    for shard in range(num_shards):
        left = num_shards - shard
        target, cur = sum(sizes[idx:]) / left, 0
        # take at least one tensor, leave at least one per remaining shard
        while idx < len(sizes) - (left - 1) and (left == 1 or cur == 0 or cur + sizes[idx] / 2 <= target):
            plan.append(shard)
            cur += sizes[idx]
            idx += 1
    return plan


def make_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int = 320,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie_word_embeddings: bool | None = None,
    dtype: str = "float32",
    seed: int = 0,
    num_shards: int = 2,
    rms_norm_eps: float = 1e-6,
    with_tokenizer: bool = True,
    init_std: float = 0.02,
) -> pathlib.Path:
    """Write a random checkpoint to ``out_dir`` (created if needed) and return its path.

    Values are drawn from one ``torch.Generator().manual_seed(seed)`` in tensor order,
    in float32, then cast to ``dtype``; they do not depend on ``num_shards``. Matrices
    and biases are N(0, init_std); norm weights are 1 + 0.1 * N(0, 1).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
    tie = (arch == "qwen2") if tie_word_embeddings is None else bool(tie_word_embeddings)
    hd = head_dim if head_dim is not None else hidden_size // num_attention_heads
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    config: dict[str, Any] = {
        "architectures": [ARCHS[arch]], "model_type": arch, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta, "hidden_act": "silu",
        "initializer_range": init_std, "tie_word_embeddings": tie, "torch_dtype": dtype, "dtype": dtype,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "use_cache": True, "attention_dropout": 0.0,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    if rope_scaling is not None:
        config["rope_scaling"] = dict(rope_scaling)
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif arch == "mistral":
        config["sliding_window"] = None
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_hidden_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    torch_dtype = DTYPES[dtype]
    elem = torch.empty((), dtype=torch_dtype).element_size()
    shapes = _weight_shapes(arch, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
                            num_key_value_heads, hd, vocab_size, tie)
    sizes = [elem * torch.Size(s).numel() for _, s in shapes]
    plan = _plan_shards(sizes, num_shards)
    names = ["model.safetensors"] if num_shards == 1 else [
        f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # leftovers of an earlier run with other sharding
    gen_rng = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for shard, fname in enumerate(names):
        tensors: dict[str, torch.Tensor] = {}
        for (name, shape), s in zip(shapes, plan):
            if s != shard:
                continue
            t = torch.randn(shape, generator=gen_rng, dtype=torch.float32)
            t = 1.0 + 0.1 * t if name.endswith("norm.weight") else t.mul_(init_std)
            tensors[name] = t.to(torch_dtype).contiguous()
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    if num_shards > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    if with_tokenizer:
        build_tokenizer(vocab_size, qwen_style=arch == "qwen2").save(str(out / "tokenizer.json"))
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True, "add_eos_token": False,
            "model_max_length": max_position_embeddings, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out
