"""The flags of `python -m engine.serve` / `tp-runtime serve` (vLLM's
`entrypoints/openai/cli_args.py`): the parser, and the checks on the parsed command
line that argparse cannot make.

Called by engine/entrypoints/cli.py `main` (and by tests) in the server's process,
before anything starts: a bad flag exits 2 with a message naming it (argparse's
convention). Importing it imports no torch, so `--help` stays fast; the value types
are in arg_types.py, the mapping to EngineConfig in engine_args.py.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from config import ATTENTION_BACKENDS, DTYPES, PLACEMENT_STRATEGIES, ConfigError, StructuredOutputsConfig
from config.parallel import TP_COMMUNICATORS
from engine.entrypoints.arg_types import (
    load_chat_template,
    max_model_len_arg,
    parse_bytes,
    port_arg,
    positive_int,
)
from engine.entrypoints.engine_args import device_is_cpu
from executor.registry import get_supported_executor_backends

GiB = 1 << 30


def structured_outputs_config_arg(text: str) -> dict[str, Any]:
    """--structured-outputs-config: vLLM's JSON object ('{"backend": "xgrammar"}'), checked
    here (an unknown key or backend is exit 2) and passed on as the dict EngineConfig takes."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        StructuredOutputsConfig(**value)
    except (ValueError, TypeError, ConfigError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e} (e.g. '{{\"backend\": \"xgrammar\"}}')") from None
    return value


class _RefuseRemoteCode(argparse.Action):
    """--trust-remote-code: a usage error (exit 2) as soon as it is parsed."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error("--trust-remote-code is refused: this server never runs code shipped with a checkpoint "
                     "(only tensors are loaded, and only the architectures it implements are served)")


UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def build_parser(prog: str = "python -m engine.serve", description: str | None = None) -> argparse.ArgumentParser:
    """The command's flags (vLLM's `make_arg_parser`): vLLM's names and value syntax,
    with our own spellings kept beside them (`--tp`, `--kv-cache-memory`, a positional
    MODEL). `description` heads --help (the command's, from cli.py)."""
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model directory (a Hugging Face checkpoint) or Hub repo id; omit to serve the built-in "
                        "demo model")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as a flag (vLLM's spelling); the positional MODEL wins if both are given")
    p.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tp", type=positive_int, default=1,
                   help="tensor-parallel size: one worker process per rank (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=port_arg, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the `model` names clients may use; the first is the one reported in responses and "
                        "metrics (default: MODEL as given, or tp-runtime-demo)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="a tokenizer directory other than the model's (tokenizer.json and its configs)")
    p.add_argument("--chat-template", default=None, metavar="PATH|TEMPLATE",
                   help="a Jinja chat template, as a file or inline, in place of the tokenizer's own")
    p.add_argument("--trust-remote-code", action=_RefuseRemoteCode, nargs=0,
                   help="refused (exit 2): this server never runs code shipped with a checkpoint")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weight and activation dtype: auto (the checkpoint's), half = float16, bfloat16, "
                        "float = float32")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto: cuda if available")
    p.add_argument("--load-format", default="auto", help="weight loader (default auto)")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8", "gptq", "awq", "compressed-tensors"],
                   help="fp8: quantise a full-precision checkpoint's weights online; the others name the method a "
                        "pre-quantised checkpoint already says it uses (default: the checkpoint's, else none)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no graphs: every decode step runs eagerly (CUDA graphs on CUDA with TRITON_ATTN; the "
                        "CPU's recorded decode steps with CPU_ATTN)")
    p.add_argument("--cudagraph-capture-sizes", type=positive_int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs (default 1 2 4 8 16 ... up to "
                        "--max-cudagraph-capture-size)")
    p.add_argument("--max-cudagraph-capture-size", type=positive_int, default=None, metavar="N",
                   help="the largest decode batch captured, or on the CPU recorded (default min(512, "
                        "--max-num-seqs))")
    p.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS,
                   help="default: TRITON_ATTN on CUDA, CPU_ATTN on the CPU (TRITON_ATTN on the CPU needs "
                        "TRITON_INTERPRET=1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: whole experts per rank (EP size = TP size) instead of each "
                        "expert sliced across the ranks")
    p.add_argument("--tp-communicator", default="auto", choices=TP_COMMUNICATORS,
                   help="how TP ranks exchange tensors (default auto: NCCL on CUDA, gloo with shared memory "
                        "on the CPU); gloo on CUDA lets the ranks share one GPU")
    p.add_argument("--no-cpu-prepack-weights", dest="cpu_prepack_weights", action="store_false",
                   help="on CPU, keep the checkpoint's layout instead of packing the linear weights (packing "
                        "replaces the weight; without it decode is slower)")
    p.add_argument("--distributed-executor-backend", default=None, choices=get_supported_executor_backends(),
                   help="how ranks run: mp (one process per rank, the default at every TP: the model "
                        "step then never waits for the HTTP server's interpreter lock), uni (in the "
                        "server's own process, TP=1 only), external_launcher (one torchrun process per "
                        "rank; only rank 0 serves), ray (one Ray actor per rank, see "
                        "--ray-placement-strategy)")
    p.add_argument("--ray-placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES,
                   help="with --distributed-executor-backend ray: PACK (the default) puts the ranks on as few nodes "
                        "as possible, SPREAD on different nodes; STRICT_ variants fail rather than do otherwise")
    p.add_argument("--cpu-threads-bind", default="auto", metavar="auto|none|CPUS",
                   help="on CPU, the cores of each rank: auto (split the available cores, the default), none, "
                        "or one cpu list per rank separated by '|', e.g. 0-3|4-7")
    p.add_argument("--revision", default=None, help="Hub revision when MODEL is a repo id")
    p.add_argument("--download-dir", default=None, help="Hub cache directory when MODEL is a repo id")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own (default 0)")
    p.add_argument("--max-model-len", type=max_model_len_arg, default=None, metavar="N",
                   help="longest prompt + completion in tokens: 2048, 2k (2000), 2K (2048), or auto / -1 "
                        "(default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="most requests in one batch (default 64)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="N",
                   help="token budget of one step (default: max(max_model_len, 2048))")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan each step while the one before it runs, so the ranks never wait for the scheduler "
                        "(default: on with the mp backend, the only one that can; --no-async-scheduling runs one "
                        "step at a time)")
    p.add_argument("--num-scheduler-steps", type=positive_int, default=1, metavar="N",
                   help="decode steps one schedule runs back to back when every request decodes and none waits: "
                        "the engine's work per step is paid once per N tokens; a new request waits up to N steps "
                        "(default 1)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block (default 16)")
    p.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory", type=parse_bytes,
                   default=None, metavar="BYTES",
                   help="KV-cache bytes per rank, e.g. 2GiB, 4G, 4000m (default: profiled with "
                        "--gpu-memory-utilization on CUDA; on CPU 1GiB, 64MiB for the demo model)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of earlier prompts that start the same way (default on)")
    p.add_argument("--max-worker-restarts", type=int, default=2, metavar="N",
                   help="replace a failed worker group (a rank died or hung) and re-run its requests, at most N "
                        "times in 10 minutes; past that, or with 0, the server exits 1 (default 2; always 0 "
                        "under torchrun, which alone can start its ranks)")
    p.add_argument("--check-weights-finite", action="store_true",
                   help="while loading, warn about every weight holding NaN or Inf, naming the tensor and its file "
                        "(reads every weight once more)")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="add POST /sleep?level=N, POST /wake_up and GET /is_sleeping: free the KV cache and the "
                        "weights between phases (RL loops, shared hosts) and get them back without a restart")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the throughput, queue and KV-cache line every 10 s")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request received (id, prompt, sampling parameters, prompt token ids) at INFO")
    p.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --enable-log-requests, show at most N prompt characters and N token ids "
                        "(default: all)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM compatibility: requests are not logged unless "
                        "--enable-log-requests (vLLM's default too, since that flag replaced this one)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                   help="sampling defaults: auto (the model's generation_config.json), vllm (none: the "
                        "server's defaults), or a directory holding a generation_config.json")
    p.add_argument("--structured-outputs-config", type=structured_outputs_config_arg, default=None, metavar="JSON",
                   help='structured outputs: {"backend": "auto"|"xgrammar", "disable_any_whitespace": bool} '
                        "(default: xgrammar, any whitespace)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model call tools on its own (tool_choice "auto", the default when a request '
                        "has tools); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls: hermes (Qwen2.5, Qwen3), llama3_json, mistral, pythonic, "
                        "or one a --tool-parser-plugin registers")
    p.add_argument("--tool-parser-plugin", default="", metavar="PATH",
                   help="a Python file that registers tool parsers with ToolParserManager.register_module(name)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split the model's thinking into the reply's `reasoning`: deepseek_r1, qwen3, mistral")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache "
                        "supplied)")
    p.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                   help="most logprobs a request may ask for (default 20; -1: no limit)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of device memory the engine may use when profiling (default 0.9); on CPU, "
                        "given without --kv-cache-memory-bytes, the KV cache is sized from this share of host "
                        "memory instead of a fixed 1GiB")
    p.add_argument("--api-key", default=os.environ.get("TP_RUNTIME_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $TP_RUNTIME_API_KEY, else none)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="this server's log level (default info)")
    p.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's log level (default: --log-level)")
    p.add_argument("--no-access-log", "--disable-uvicorn-access-log", dest="access_log", action="store_false",
                   help="do not log every HTTP request")
    return p


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad flag exits 2 with a message naming it
    (argparse's convention). Sets `args.model` (positional or --model, None for the demo
    model), `args.chat_template_text` (the --chat-template read, or None) and
    `args.uvicorn_log_level` (--log-level unless given)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None and args.model_flag is not None and args.model_tag != args.model_flag:
        parser.error(f"two models given: {args.model_tag!r} (positional) and --model {args.model_flag!r}")
    args.model = args.model_tag if args.model_tag is not None else args.model_flag
    if args.max_worker_restarts < 0:
        parser.error(f"--max-worker-restarts {args.max_worker_restarts}: must be >= 0")
    if args.max_logprobs < -1:
        parser.error(f"--max-logprobs {args.max_logprobs}: must be >= 0, or -1 for no limit")
    if args.max_log_len is not None and args.max_log_len < 0:
        parser.error(f"--max-log-len {args.max_log_len}: must be >= 0")
    if args.gpu_memory_utilization is not None and not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error(f"--gpu-memory-utilization {args.gpu_memory_utilization}: must be in (0, 1]")
    if args.chat_template is not None:
        try:
            args.chat_template_text = load_chat_template(args.chat_template)
        except (OSError, ValueError) as e:
            parser.error(str(e))
    else:
        args.chat_template_text = None
    if args.generation_config not in ("auto", "vllm") and not Path(args.generation_config).is_dir():
        parser.error(f"--generation-config {args.generation_config!r}: not auto, vllm or a directory")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        parser.error(f"--tokenizer {args.tokenizer!r} is not a directory")
    if args.kv_cache_memory is not None and args.kv_cache_memory <= 0:
        parser.error(f"--kv-cache-memory-bytes {args.kv_cache_memory}: must be > 0")
    if args.kv_cache_memory is not None and device_is_cpu(args.device):
        import psutil

        ranks_here = args.tp if args.distributed_executor_backend != "external_launcher" else 1
        total = psutil.virtual_memory().total
        if args.kv_cache_memory * ranks_here > total:
            parser.error(
                f"--kv-cache-memory-bytes {args.kv_cache_memory} ({args.kv_cache_memory / GiB:.1f} GiB per rank, "
                f"x{ranks_here} rank(s) on this host) is more than this host's memory ({total / GiB:.1f} GiB)")
    _check_parsers(parser, args)
    args.uvicorn_log_level = args.uvicorn_log_level or args.log_level
    return args


def _check_parsers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tool-parser-plugin is imported (its parsers register), then the parser names
    are checked against the registries: an unknown one exits 2 listing the known."""
    if args.tool_parser_plugin:
        import importlib.util

        spec = importlib.util.spec_from_file_location("tool_parser_plugin", args.tool_parser_plugin)
        if spec is None or spec.loader is None or not Path(args.tool_parser_plugin).is_file():
            parser.error(f"--tool-parser-plugin {args.tool_parser_plugin!r} is not a Python file")
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as e:  # noqa: BLE001 - any failure of the plugin is a bad flag
            parser.error(f"--tool-parser-plugin {args.tool_parser_plugin!r} failed to load: {type(e).__name__}: {e}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser is not None:
        from engine.entrypoints.openai.tool_parsers import ToolParserManager

        try:
            ToolParserManager.get_tool_parser(args.tool_call_parser)
        except KeyError as e:
            parser.error(f"--tool-call-parser: {e.args[0]}")
    if args.reasoning_parser is not None:
        from engine.reasoning import ReasoningParserManager

        try:
            ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
        except KeyError as e:
            parser.error(f"--reasoning-parser: {e.args[0]}")


def serving_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `build_app` keywords of the tool, reasoning and usage flags."""
    return {"enable_auto_tool_choice": args.enable_auto_tool_choice, "tool_call_parser": args.tool_call_parser,
            "reasoning_parser": args.reasoning_parser,
            "enable_prompt_tokens_details": args.enable_prompt_tokens_details}
