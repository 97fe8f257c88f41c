"""Shared fixtures: tiny checkpoints, a transformers oracle, and a TP process launcher.

- `tiny_models`: session-scoped {name: checkpoint dir} of small random models, written
  once by engine/tiny_model.py (hidden 64, 2 layers; see `TINY_MODEL_SPECS`).
- `copy_model(name)`: a private copy of one of them under tmp_path, for tests that
  damage a checkpoint.
- `hf_logits(name)`: (input_ids [T], transformers float32 logits [T, vocab]) per model,
  computed once per session.
- `free_port()` and `run_tp(fn, world_size, *args)`: run `fn(rank, world_size, port, *args)`
  in `world_size` spawned processes and return the per-rank results in rank order. The
  `fn`s live in tests/tp_helpers.py because spawn pickles functions by name.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue as queue_mod
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

import os

import pytest
import torch

# Without a GPU the Triton attention backend (TRITON_ATTN) runs under Triton's
# interpreter, on CPU tensors. Triton reads this when a kernel module is imported, and
# spawned workers inherit it, so it is set before anything imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.tiny_model import make_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Small checkpoints shared by the whole session. init_std 0.1 (not the generator's 0.02)
# makes attention far from uniform, so RoPE and head-layout mistakes change the logits.
_COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, init_std=0.1,
                               with_tokenizer=False)
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
TINY_MODEL_SPECS: dict[str, dict[str, Any]] = {
    # 4 heads / 2 kv heads: TP=4 replicates each kv head on two ranks.
    "llama": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, vocab_size=320, seed=1),
    "mistral": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2, vocab_size=320, seed=2,
                    num_shards=3),
    "qwen2": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, vocab_size=320, seed=3,
                  tie_word_embeddings=False),
    # Tied embeddings: the checkpoint has no lm_head.weight.
    "qwen2_tied": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=4, vocab_size=320, seed=4,
                       tie_word_embeddings=True),
    # 8 heads / 2 kv heads: kv heads fewer than TP=4.
    "llama_h8_kv2": dict(arch="llama", num_attention_heads=8, num_key_value_heads=2, vocab_size=320, seed=5),
    # Vocab sizes divisible by neither 64 nor the TP size.
    "llama_v250": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, vocab_size=250, seed=6),
    "mistral_v333": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=1, vocab_size=333, seed=7),
    "qwen2_tied_v333": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, vocab_size=333, seed=8,
                            tie_word_embeddings=True),
    "llama3_rope": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, vocab_size=256, seed=9,
                        max_position_embeddings=512, rope_scaling=LLAMA3_ROPE_SCALING),
    # One shard, no index: for tests that add stray files.
    "llama_1shard": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, vocab_size=320, seed=10,
                         num_shards=1),
}
NUM_TOKENS = 24


def tiny_llama_with_tokenizer(out_dir: Path, **overrides: Any) -> Path:
    """A tiny random llama (hidden 64, 2 layers, seed 11) WITH its byte-level BPE
    tokenizer.json and chat template, which the session's `tiny_models` lack."""
    spec: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, seed=11,
                                with_tokenizer=True)
    return make_tiny_model(out_dir, "llama", **{**spec, **overrides})


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The servers' model (tests/test_serve.py and the others that start engine.serve): a
    tiny llama with a tokenizer and chat template (vocab 512, 4 heads / 2 kv heads)."""
    return tiny_llama_with_tokenizer(
        tmp_path_factory.mktemp("serve_model") / "tiny", num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=512, init_std=0.1,
    )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for name, spec in TINY_MODEL_SPECS.items():
        spec = dict(spec)
        arch = spec.pop("arch")
        dirs[name] = make_tiny_model(root / name, arch, **{**_COMMON, **spec})
    return dirs


@pytest.fixture
def copy_model(tiny_models: dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    """copy_model(name) -> a fresh, private copy of that checkpoint directory."""

    def copy(name: str) -> Path:
        dst = tmp_path / f"copy_{name}"
        shutil.copytree(tiny_models[name], dst)
        return dst

    return copy


def input_ids_for(name: str, vocab_size: int, num_tokens: int = NUM_TOKENS) -> torch.Tensor:
    """Deterministic token ids for a model; they cover the top of the vocab too."""
    gen = torch.Generator().manual_seed(1234 + sum(map(ord, name)))
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    ids[-1] = vocab_size - 1  # lives in the last (padded) vocab shard
    return ids


@pytest.fixture(scope="session")
def hf_logits(tiny_models: dict[str, Path]) -> Callable[[str], tuple[torch.Tensor, torch.Tensor]]:
    """hf_logits(name) -> (input_ids, transformers float32 logits), cached per name."""
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in cache:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(tiny_models[name]), dtype=torch.float32)
            hf.eval()
            ids = input_ids_for(name, hf.config.vocab_size)
            with torch.no_grad():
                logits = hf(ids[None], position_ids=torch.arange(ids.numel())[None]).logits[0]
            cache[name] = (ids, logits.float().clone())
            del hf
        return cache[name]

    return get


def free_port() -> int:
    """A currently free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkerError(RuntimeError):
    """One or more spawned ranks failed; the message holds each one's traceback."""


def run_tp(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run `fn(rank, world_size, port, *args)` in `world_size` spawned processes.

    Returns the ranks' return values in rank order. A rank that raises or dies makes this
    raise `TPWorkerError` with the rank and its traceback (or exit code); so does the
    deadline. Every process is killed and joined before this returns, whatever happens.
    A rendezvous port lost to another process between `free_port()` and its use is
    retried once with a new port.
    """
    try:
        return _run_tp_once(fn, world_size, args, timeout)
    except TPWorkerError as e:
        if "address already in use" not in str(e).lower():
            raise
    return _run_tp_once(fn, world_size, args, timeout)


def _run_tp_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    from tests.tp_helpers import worker_entry

    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker_entry, args=(fn, rank, world_size, port, args, results_q),
                    name=f"tp-rank-{rank}", daemon=True)
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_error_at: float | None = None
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                errors.setdefault(-1, f"timed out after {timeout:.0f}s; ranks without a result: "
                                      f"{sorted(set(range(world_size)) - set(results) - set(errors))}")
                break
            # After a failure, give the other ranks a moment to report theirs, then stop:
            # they may be stuck in a collective with the failed rank.
            if first_error_at is not None and now - first_error_at > 2.0:
                break
            try:
                status, rank, payload = results_q.get(timeout=0.1)
            except queue_mod.Empty:
                for rank, p in enumerate(procs):
                    if p.exitcode is not None and rank not in results and rank not in errors:
                        try:  # its last message may still be in the pipe
                            status, r, payload = results_q.get(timeout=0.5)
                        except queue_mod.Empty:
                            errors[rank] = f"rank {rank} exited with code {p.exitcode} without a result"
                            first_error_at = first_error_at or time.monotonic()
                        else:
                            if status == "ok":
                                results[r] = pickle.loads(payload)
                            else:
                                errors[r] = payload
                                first_error_at = first_error_at or time.monotonic()
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                first_error_at = first_error_at or time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results_q.close()
        results_q.join_thread()
    if errors:
        fn_name = getattr(fn, "__qualname__", repr(fn))
        details = "\n".join(
            (f"--- rank {r} ---\n{msg}" if r >= 0 else f"--- {msg}") for r, msg in sorted(errors.items())
        )
        raise TPWorkerError(f"{fn_name} failed at world_size={world_size}:\n{details}")
    return [results[r] for r in range(world_size)]


@pytest.fixture(scope="session")
def tp_runner() -> Callable[..., list[Any]]:
    return run_tp


@pytest.fixture(scope="session")
def gguf_avx2_kernels(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The GGUF kernels built for AVX2 without AVX-512 (gguf_avx2.c's int8 products and
    gguf_avx2_tiles.c's tiles, as on Zen 3 or Haswell; built here whatever this CPU adds),
    once a session (a build takes about 10 s), in a cache of their own; None where it
    cannot be built."""
    from distributed.native_build import load_kernel
    from models.layers.quantization import gguf_kernels

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TP_RUNTIME_CACHE", str(tmp_path_factory.mktemp("gguf-avx2-kernels")))
        return load_kernel(gguf_kernels.SOURCES, ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off",
                                                  "-fopenmp", "-fPIC"), gguf_kernels.LINK_FLAGS,
                           gguf_kernels.LINK_LIBS, gguf_kernels.GGUFKernels, "%s")
