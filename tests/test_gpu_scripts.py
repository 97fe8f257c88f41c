"""The GPU machine's prepared run, checked on the CPU: scripts/gpu_check.sh parses and fits
its time budget, bench_gpu.py's arithmetic (the rooflines) is right for known shapes, its
checkpoint writer makes loadable files, its CPU mode runs end to end, and the smoke
script's near-tie rule accepts a flip only where the reference itself nearly tied."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))

from bench_gpu_model import SHAPES, decode_bytes_per_step, mean_decode_context, prefill_flops, \
    write_random_checkpoint  # noqa: E402
from smoke_multi_gpu import SmokeFailure, compare  # noqa: E402

GPU_MACHINE_BUDGET_S = 8 * 60


# --------------------------------------------------------------------------- gpu_check.sh


def test_gpu_check_script_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_check_steps_fit_the_machines_eight_minutes() -> None:
    text = (SCRIPTS / "gpu_check.sh").read_text()
    total = int(re.search(r'^TOTAL_S="\$\{TOTAL_S:-(\d+)\}"', text, re.MULTILINE).group(1))
    steps = dict(re.findall(r"^run_step (\w+) (\d+) ", text, re.MULTILINE))
    assert set(steps) == {"wheels", "env", "pytest", "smoke", "bench", "tp"}
    assert sum(map(int, steps.values())) <= total < GPU_MACHINE_BUDGET_S
    # Every log lands under $OUT, and no more files than the machine returns (8).
    logs = set(re.findall(r'"\$OUT/([\w.]+)"', text)) | {"env.txt", "summary.txt"}
    assert len(logs) <= 8, logs


# --------------------------------------------------------------------------- the rooflines' arithmetic


def test_shapes_have_the_published_parameter_counts() -> None:
    assert SHAPES["1b"].num_params == 1_235_814_400  # Llama-3.2-1B
    assert SHAPES["8b"].num_params == 8_030_261_248  # Llama-3.1-8B
    # K and V of one token: layers x 2 x 8 kv heads x head_dim x 2 bytes.
    assert SHAPES["1b"].kv_bytes_per_token() == 16 * 2 * 8 * 64 * 2 == 32768
    assert SHAPES["8b"].kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131072


def test_decode_bytes_per_step_of_the_tiny_shape() -> None:
    # tiny: hidden 64, intermediate 128, 2 layers, 4 heads / 2 kv heads of 16, vocab 320.
    # Per layer: q, o 64x64 each; k, v 32x64 each; gate, up, down 128x64 each = 36864.
    layers = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
    lm_head, norms, embedding_row = 320 * 64, (2 * 2 + 1) * 64, 64
    kv_per_token = 2 * 2 * 2 * 16 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    expected = (layers + lm_head + norms + embedding_row) * 2 + 10 * kv_per_token
    assert expected == 191744
    assert decode_bytes_per_step(SHAPES["tiny"], batch=1, context_len=10) == expected
    # Batch 4: the weights once, four embedding rows, four sequences' K/V.
    assert decode_bytes_per_step(SHAPES["tiny"], 4, 10) == expected + 3 * 64 * 2 + 3 * 10 * kv_per_token


def test_decode_bytes_read_every_weight_once() -> None:
    one_b, eight_b = SHAPES["1b"], SHAPES["8b"]
    # Tied (1B): the lm_head is the embedding, read in full: every parameter, plus one row.
    assert decode_bytes_per_step(one_b, 1, 0) == (one_b.num_params + one_b.hidden_size) * 2
    # Untied (8B): the embedding only for the batch's row.
    embedding = eight_b.vocab_size * eight_b.hidden_size
    assert decode_bytes_per_step(eight_b, 1, 0) == (eight_b.num_params - embedding + eight_b.hidden_size) * 2
    # 1k tokens of context at batch 32 add 32 x 1024 x 128 KiB of K/V to the 8B step.
    assert decode_bytes_per_step(eight_b, 32, 1024) - decode_bytes_per_step(eight_b, 32, 0) == 32 * 1024 * 131072


def test_prefill_flops_and_mean_context() -> None:
    tiny = SHAPES["tiny"]
    # 2 x linear weights x every token, 2 x lm_head x each sequence's last token.
    assert prefill_flops(tiny, num_seqs=2, prompt_len=64) == 2 * 73728 * 128 + 2 * 20480 * 2
    eight_b = SHAPES["8b"]
    per_token = prefill_flops(eight_b, 8, 2048) / (8 * 2048)
    assert 2 * 6.9e9 < per_token < 2 * 7.0e9  # the 8B's ~6.98e9 linear weights in its layers
    assert mean_decode_context(128, 128) == 192


def test_random_checkpoint_loads_as_its_config_says(tmp_path: Path) -> None:
    from safetensors import safe_open

    shape = SHAPES["tiny"]
    out = write_random_checkpoint(shape, tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2 and config["dtype"] == "bfloat16"
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    assert {name: tuple(t.shape) for name, t in tensors.items()} == dict(shape.weight_shapes())
    assert sum(t.numel() for t in tensors.values()) == shape.num_params
    q = tensors["model.layers.1.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - 0.02) < 0.005 and (tensors["model.norm.weight"] == 1).all()


# --------------------------------------------------------------------------- bench_gpu.py, CPU mode


@pytest.mark.slow
def test_bench_gpu_cpu_mode_runs_end_to_end_and_prints_its_table() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_gpu.py"), "--device", "cpu", "--shape", "tiny",
                           "--rounds", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^card limits: copy \d+ GB/s .* bf16 matmul 256\^3 [\d.]+ TFLOP/s$", out, re.MULTILINE), out
    assert "FAILED" not in out, out
    rows = {
        ("ours", "ready"), ("ours", "ready, 2nd start"), ("ours", "decode batch 1"), ("ours", "decode batch 32"),
        ("ours", "prefill 2 seqs"), ("ours (eager)", "ready"), ("ours (eager)", "decode batch 1"),
        ("transformers", "load"), ("transformers", "decode batch 1"), ("transformers", "decode batch 32"),
        ("transformers", "prefill 2 seqs"),
    }
    for engine, label in rows:
        assert re.search(rf"^tiny  {re.escape(engine)} +{label} +[\d.]+ (s|tok/s).*  rss [\d.]+ GiB", out,
                         re.MULTILINE), (engine, label, out)
    targets = re.findall(r"^TARGET (.*)$", out, re.MULTILINE)
    assert len(targets) == 4, out
    assert all("PASS" not in t and "MISS" not in t for t in targets), targets  # nothing judged on a CPU
    assert re.search(r"TARGET batch-1 decode, tiny-llama: \d+ tok/s = [\d.]+% of the copy roofline", out)
    assert re.search(r"TARGET batch-32 decode, tiny-llama: ours / transformers = [\d.]+x", out)
    assert re.search(r"TARGET 64-token prefill, tiny-llama: \d+ tok/s = [\d.]+ TFLOP/s = [\d.]+% of the bf16", out)
    assert re.search(r"TARGET time to ready, tiny-llama: [\d.]+ s \(second start; the first", out)


# --------------------------------------------------------------------------- the smoke script's near-tie rule


def test_smoke_compare_accepts_only_near_tie_flips(capsys: pytest.CaptureFixture[str]) -> None:
    want = [[5, 6, 7, 8], [9, 9, 9]]
    logprobs = [[{5: -0.1}, {6: -1.00, 40: -1.05}, {7: -0.2}, {8: -0.3}], [{9: -0.1}] * 3]
    compare("same", [list(x) for x in want], want)  # identical: fine without logprobs
    compare("flip", [[5, 40, 1, 2], [9, 9, 9]], want, logprobs)  # 6 vs 40 within 0.05: a near-tie
    assert "sequence 0 flips a near-tie at token 1" in capsys.readouterr().out
    with pytest.raises(SmokeFailure, match="greedy tokens differ"):
        compare("strict", [[5, 40, 1, 2], [9, 9, 9]], want)  # no logprobs: must be identical
    with pytest.raises(SmokeFailure, match="not at a near-tie"):
        compare("far", [[5, 6, 7, 8], [9, 3, 9]], want, logprobs)  # 3 is not among the reference's top two
    far_logprobs = [[{5: -0.1}, {6: -0.1, 40: -3.0}, {7: -0.2}, {8: -0.3}], [{9: -0.1}] * 3]
    with pytest.raises(SmokeFailure, match="not at a near-tie"):
        compare("gap", [[5, 40, 7, 8], [9, 9, 9]], want, far_logprobs)  # second choice, but 2.9 nats behind
