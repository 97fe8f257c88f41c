"""The models of scripts/bench_gpu.py: their shapes, what a step of each must move and
compute (the rooflines' arithmetic), and a random bfloat16 checkpoint written in seconds.

- `SHAPES`: Llama-3.2-1B and Llama-3.1-8B as published (config.json values, parameter
  counts 1,235,814,400 and 8,030,261,248), and a tiny one for the CPU.
- `decode_bytes_per_step(shape, batch, context_len)`: the bytes one decode step must read
  from memory at least: every weight once (the embedding only for the batch's rows; a
  tied lm_head is the embedding, read in full), and every sequence's K/V. Over the
  device's copy bandwidth that is the step's least time (the batch-1 roofline).
- `prefill_flops(shape, num_seqs, prompt_len)`: 2 x the parameters a token multiplies x
  its tokens (the layers' linear weights for every token, the lm_head for the last token
  of each sequence: only those are sampled). Attention's own FLOPs are not counted (about
  4% of the total at 2k tokens for the 8B shape), so the percentage is a lower bound.
- `write_random_checkpoint(shape, out_dir, device)`: config.json and safetensors shards,
  no tokenizer (the benchmark sends token ids). Every weight is a view of one random pool
  (values N(0, 0.02), drawn once on `device`), written straight from it by one thread
  per shard: 16 GB in a few seconds where the page cache takes it.

Imported by bare name from bench_gpu.py and tests/test_gpu_scripts.py; no torch at
import time (only the writer needs it).
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BF16_BYTES = 2
INIT_STD = 0.02
BOS_ID, EOS_ID = 128000, 128001  # Llama 3's (1 and 2 in a smaller vocabulary); the benchmark ignores EOS
SHARD_BYTES = 2 << 30  # a shard per ~2 GiB: a writer thread per shard


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-architecture model's dimensions, as its config.json gives them."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 131072
    rope_theta: float = 500000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5

    @property
    def layer_linear_params(self) -> int:
        """The q, k, v, o, gate, up and down weights of every layer."""
        h, hd = self.hidden_size, self.head_dim
        attn = 2 * h * self.num_attention_heads * hd + 2 * h * self.num_key_value_heads * hd
        return self.num_hidden_layers * (attn + 3 * h * self.intermediate_size)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        return (2 * self.num_hidden_layers + 1) * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter once (a tied lm_head is the embedding)."""
        untied_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.vocab_size * self.hidden_size + self.layer_linear_params + self.norm_params + untied_head

    def kv_bytes_per_token(self, elem_bytes: int = BF16_BYTES) -> int:
        """K and V of one token in every layer."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * elem_bytes

    @property
    def bos_eos_ids(self) -> tuple[int, int]:
        return (BOS_ID, EOS_ID) if self.vocab_size > EOS_ID else (1, 2)

    def hf_config(self) -> dict[str, Any]:
        """config.json for LlamaForCausalLM in bfloat16."""
        bos, eos = self.bos_eos_ids
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "initializer_range": INIT_STD, "use_cache": True,
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "bfloat16", "dtype": "bfloat16",
        }
        if self.rope_scaling is not None:
            config["rope_scaling"] = dict(self.rope_scaling)
        return config

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor of the checkpoint, in file order."""
        from engine.tiny_model import _weight_shapes  # the one list of a Llama checkpoint's names

        return _weight_shapes("llama", self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                              self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.vocab_size,
                              self.tie_word_embeddings)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


SHAPES: dict[str, LlamaShape] = {
    "1b": LlamaShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, 128256, True, rope_scaling=_llama3_rope(32.0)),
    "8b": LlamaShape("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256, False, rope_scaling=_llama3_rope(8.0)),
    "tiny": LlamaShape("tiny-llama", 64, 128, 2, 4, 2, 16, 320, False, max_position_embeddings=4096,
                       rope_theta=10000.0),
}


def decode_bytes_per_step(shape: LlamaShape, batch: int, context_len: int, elem_bytes: int = BF16_BYTES) -> int:
    """The least bytes one decode step of `batch` sequences, each attending to
    `context_len` tokens (its new one included), reads: every linear and norm weight and
    the lm_head once, the embedding rows of the batch's tokens, and each sequence's K/V."""
    weights = shape.layer_linear_params + shape.lm_head_params + shape.norm_params
    embedding_rows = batch * shape.hidden_size
    kv = batch * context_len * shape.kv_bytes_per_token(elem_bytes)
    return (weights + embedding_rows) * elem_bytes + kv


def prefill_flops(shape: LlamaShape, num_seqs: int, prompt_len: int) -> int:
    """2 x parameters x tokens: the layers' linear weights for every prompt token, the
    lm_head for each sequence's last (the only logits sampled); attention's not counted."""
    return 2 * shape.layer_linear_params * num_seqs * prompt_len + 2 * shape.lm_head_params * num_seqs


def mean_decode_context(prompt_len: int, max_tokens: int) -> float:
    """The mean context of the decode steps of a request that generates `max_tokens`
    after a `prompt_len` prompt: the first token comes from the prefill, then step i
    (1..max_tokens-1) attends to prompt_len + i tokens."""
    return prompt_len + max_tokens / 2


# --------------------------------------------------------------------------- the checkpoint


def _safetensors_header(entries: list[tuple[str, tuple[int, ...], int]]) -> bytes:
    """The length-prefixed header of a bfloat16 safetensors file holding `entries`
    (name, shape, bytes) back to back, padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, nbytes in entries:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_random_checkpoint(shape: LlamaShape, out_dir: Path, device: str = "cpu") -> Path:
    """Write config.json, generation_config.json and bfloat16 safetensors shards (with
    their index) of a random `shape` model to `out_dir` (created); returns it. Matrices
    are views of one N(0, 0.02) pool drawn on `device` (identical layers: the benchmark
    measures speed, not text); norm weights are 1. Peak host memory: the pool (the
    largest tensor, 1 GiB for the 8B shape's embedding)."""
    import torch

    from engine.tiny_model import _plan_shards

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(shape.hf_config(), indent=2) + "\n")
    bos, eos = shape.bos_eos_ids
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    tensors = shape.weight_shapes()
    numels = [torch.Size(s).numel() for _, s in tensors]
    generator = torch.Generator(device=device).manual_seed(0)
    pool = torch.randn(max(numels), generator=generator, device=device).mul_(INIT_STD).to(torch.bfloat16).cpu()
    ones = torch.ones(max(s[0] for _, s in tensors if len(s) == 1), dtype=torch.bfloat16)
    pool_bytes, ones_bytes = pool.view(torch.uint8).numpy(), ones.view(torch.uint8).numpy()
    if device == "cuda":
        torch.cuda.empty_cache()  # the draw's blocks back to the driver: the engines measure the device's free memory

    sizes = [n * BF16_BYTES for n in numels]
    num_shards = max(1, min(len(tensors), -(-sum(sizes) // SHARD_BYTES)))
    plan = _plan_shards(sizes, num_shards)
    names = ["model.safetensors"] if num_shards == 1 else [
        f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]

    def write_shard(shard: int) -> None:
        entries = [(name, s, size) for (name, s), size, p in zip(tensors, sizes, plan) if p == shard]
        header = _safetensors_header(entries)
        with open(out_dir / names[shard], "wb") as f:
            f.write(header)
            for name, s, size in entries:
                f.write(memoryview(ones_bytes if len(s) == 1 else pool_bytes)[:size])

    with ThreadPoolExecutor(max_workers=min(8, num_shards)) as threads:
        list(threads.map(write_shard, range(num_shards)))
    if num_shards > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {name: names[p] for (name, _), p in zip(tensors, plan)}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out_dir
