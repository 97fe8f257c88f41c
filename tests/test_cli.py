"""The `python -m engine.serve` / `tp-runtime serve` command line: vLLM's flag names and
value syntax, and the refusals that must come before any model loads.

Most tests parse in process (no engine); the few that run the command check that it
exits with the right code and message before loading anything (the model directory
is empty, so a load would fail differently). Servers that really serve are in
tests/test_serve.py and tests/test_tokenization_routes.py.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from engine.entrypoints.arg_types import (
    human_readable_int,
    load_chat_template,
    max_model_len_arg,
    parse_bytes,
)
from engine.entrypoints.cli_args import build_parser, parse_args
from engine.entrypoints.engine_args import engine_config_kwargs
from tests.conftest import REPO


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.serve", *args], cwd=REPO, capture_output=True, text=True,
                          check=False,
                          timeout=120)


def test_vllm_spellings_parse() -> None:
    args = parse_args(["-tp", "2", "--model", "some/model", "--enforce-eager", "--block-size", "32",
                       "--max-num-batched-tokens", "4k", "--gpu-memory-utilization", "0.5",
                       "--enable-prefix-caching", "--disable-log-requests", "--disable-log-stats",
                       "--generation-config", "vllm", "--max-logprobs", "5", "--uvicorn-log-level", "trace",
                       "--served-model-name", "a", "b", "--dtype", "half", "--disable-uvicorn-access-log"])
    assert (args.tp, args.model, args.block_size, args.max_num_batched_tokens) == (2, "some/model", 32, 4000)
    assert args.gpu_memory_utilization == 0.5 and args.enable_prefix_caching and args.enforce_eager
    assert args.disable_log_requests and args.disable_log_stats and not args.access_log
    assert (args.generation_config, args.max_logprobs, args.uvicorn_log_level) == ("vllm", 5, "trace")
    assert args.served_model_name == ["a", "b"] and args.dtype == "half"
    # Ours stay: --tp, --tensor-parallel-size, --kv-cache-memory, the positional model.
    assert parse_args(["m", "--tp", "3"]).tp == 3 == parse_args(["m", "--tensor-parallel-size", "3"]).tp
    old, new = parse_args(["m", "--kv-cache-memory", "1GiB"]), parse_args(["m", "--kv-cache-memory-bytes", "1G"])
    assert old.kv_cache_memory == new.kv_cache_memory == 1 << 30
    assert parse_args(["m"]).model == "m" and parse_args([]).model is None
    assert parse_args(["m", "--model", "m"]).model == "m"
    assert parse_args(["m", "--max-worker-restarts", "0"]).max_worker_restarts == 0
    torchrun = parse_args(["m", "--distributed-executor-backend", "external_launcher"])
    assert engine_config_kwargs(torchrun, "m")["max_worker_restarts"] == 0  # only torchrun starts its ranks
    defaults = parse_args(["m"])
    assert defaults.max_worker_restarts == 2
    # The server runs the model in its own process at every TP (vLLM's engine core / API
    # server split); uni, asked for, keeps it in the server's process.
    for tp in ("1", "2"):
        assert engine_config_kwargs(parse_args(["m", "--tp", tp]), "m")["distributed_executor_backend"] == "mp"
    uni = parse_args(["m", "--distributed-executor-backend", "uni"])
    assert engine_config_kwargs(uni, "m")["distributed_executor_backend"] == "uni"
    assert (defaults.max_logprobs, defaults.generation_config, defaults.uvicorn_log_level) == (20, "auto", "info")
    assert parse_args(["m", "--log-level", "debug"]).uvicorn_log_level == "debug"
    logged = parse_args(["m", "--enable-log-requests", "--max-log-len", "100"])
    assert logged.enable_log_requests and logged.max_log_len == 100
    assert not defaults.enable_log_requests and defaults.max_log_len is None


def test_served_model_names_do_not_swallow_the_model() -> None:
    args = parse_args(["the-model", "--served-model-name", "a", "b"])
    assert args.model == "the-model" and args.served_model_name == ["a", "b"]


@pytest.mark.parametrize("dtype", ["auto", "half", "float16", "bfloat16", "float", "float32"])
def test_every_vllm_dtype_spelling_is_an_engine_dtype(dtype: str, tmp_path: Path) -> None:
    from config import DTYPES

    assert parse_args(["m", "--dtype", dtype]).dtype == dtype
    assert dtype == "auto" or dtype in DTYPES


def test_max_model_len_syntax_is_vllms() -> None:
    assert [max_model_len_arg(v) for v in ("2048", "1k", "1K", "25.6k", "1m", "2M")] == [
        2048, 1000, 1024, 25600, 10**6, 2 << 20]
    assert max_model_len_arg("auto") is None and max_model_len_arg("-1") is None
    assert parse_args(["m", "--max-model-len", "1K"]).max_model_len == 1024
    for bad in ("1.5K", "lots", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad.replace(".", r"\.")):
            max_model_len_arg(bad)
    assert human_readable_int(" 7 ") == 7


def test_byte_counts_take_both_syntaxes() -> None:
    assert parse_bytes("16MiB") == 16 << 20 and parse_bytes("1.5GB") == 3 << 29 and parse_bytes("1024") == 1024
    assert parse_bytes("4k") == 4000 and parse_bytes("4K") == 4096 and parse_bytes("2G") == 2 << 30
    assert parse_bytes("1.5G") == 3 << 29 and parse_bytes("2.5m") == 2_500_000
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte count"):
        parse_bytes("much")


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_bad_port_is_a_usage_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --port" in _usage_error(["m", "--port", port], capsys)


def test_refusals_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--trust-remote-code is refused" in _usage_error(["m", "--trust-remote-code"], capsys)
    assert "--max-logprobs" in _usage_error(["m", "--max-logprobs", "-2"], capsys)
    assert "--max-worker-restarts" in _usage_error(["m", "--max-worker-restarts", "-1"], capsys)
    assert "--max-log-len" in _usage_error(["m", "--max-log-len", "-1"], capsys)
    assert "--gpu-memory-utilization" in _usage_error(["m", "--gpu-memory-utilization", "1.5"], capsys)
    assert "--generation-config" in _usage_error(["m", "--generation-config", str(tmp_path / "nope")], capsys)
    assert "--tokenizer" in _usage_error(["m", "--tokenizer", str(tmp_path / "nope")], capsys)
    assert "--chat-template" in _usage_error(["m", "--chat-template", "no-such-template.jinja"], capsys)
    assert "two models" in _usage_error(["a", "--model", "b"], capsys)
    assert "--dtype" in _usage_error(["m", "--dtype", "fp4"], capsys)
    huge = str(4 * psutil.virtual_memory().total)
    message = _usage_error(["m", "--device", "cpu", "--kv-cache-memory-bytes", huge], capsys)
    assert "--kv-cache-memory-bytes" in message and "host's memory" in message
    # Four ranks' worth of a third of the memory each is too much as well.
    third = str(psutil.virtual_memory().total // 3)
    assert "x4 rank" in _usage_error(["m", "--device", "cpu", "-tp", "4", "--kv-cache-memory-bytes", third], capsys)


def test_chat_template_is_a_file_or_inline(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    long_inline = "{{ bos_token }}" + "x" * 5000  # longer than any file name
    assert load_chat_template(long_inline) == long_inline
    with pytest.raises(ValueError, match="looks like a path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert parse_args(["m", "--chat-template", str(path)]).chat_template_text == path.read_text()


def test_help_lists_vllms_flags() -> None:
    text = build_parser().format_help()
    for flag in ("-tp", "--tensor-parallel-size", "--model", "--enforce-eager", "--tokenizer", "--chat-template",
                 "--block-size", "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
                 "--enable-prefix-caching", "--disable-log-requests", "--disable-log-stats", "--generation-config",
                 "--max-logprobs", "--uvicorn-log-level", "--trust-remote-code", "--served-model-name"):
        assert flag in text, flag


def test_trust_remote_code_exits_2_before_anything_starts(tmp_path: Path) -> None:
    out = _run(str(tmp_path), "--trust-remote-code")
    assert out.returncode == 2, out
    assert "--trust-remote-code is refused" in out.stderr and "never runs code" in out.stderr


def test_a_port_in_use_fails_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # An empty directory: had it got as far as loading, it would fail on the model instead.
        out = _run(str(tmp_path), "--device", "cpu", "--port", str(port))
    assert out.returncode == 1, out
    assert "--host/--port" in out.stderr and "Address already in use" in out.stderr, out.stderr
    assert "with config:" not in out.stderr and "cannot start the engine" not in out.stderr


def test_console_script_runs_serve() -> None:
    script = shutil.which("tp-runtime")
    if script is None:
        pytest.skip("the tp-runtime console script is not installed (pip install -e .)")
    out = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.startswith("usage: tp-runtime serve"), out
    assert "--served-model-name" in out.stdout
    wrong = subprocess.run([script, "run", "m"], capture_output=True, text=True, timeout=120, check=False)
    assert wrong.returncode == 2 and "the only command is `serve`" in wrong.stderr


def test_console_entry_point_is_declared() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tp-runtime"] == "engine.entrypoints.cli:console_main"


def test_check_weights_finite_reaches_the_config() -> None:
    assert engine_config_kwargs(parse_args(["m", "--check-weights-finite"]), "m")["check_weights_finite"] is True
    assert engine_config_kwargs(parse_args(["m"]), "m")["check_weights_finite"] is False


def test_async_scheduling_flags_reach_the_config() -> None:
    """vLLM's flag pair; unset leaves the engine's choice (on with mp)."""
    assert engine_config_kwargs(parse_args(["m"]), "m")["async_scheduling"] is None
    assert engine_config_kwargs(parse_args(["m", "--async-scheduling"]), "m")["async_scheduling"] is True
    assert engine_config_kwargs(parse_args(["m", "--no-async-scheduling"]), "m")["async_scheduling"] is False


def test_num_scheduler_steps_flag_reaches_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's --num-scheduler-steps (multi-step decode): 1 unless given, at least 1."""
    assert engine_config_kwargs(parse_args(["m"]), "m")["num_scheduler_steps"] == 1
    assert engine_config_kwargs(parse_args(["m", "--num-scheduler-steps", "4"]), "m")["num_scheduler_steps"] == 4
    for bad in ("0", "-1", "2.5", "many"):
        assert "argument --num-scheduler-steps" in _usage_error(["m", "--num-scheduler-steps", bad], capsys), bad
    assert "--num-scheduler-steps" in build_parser().format_help()
