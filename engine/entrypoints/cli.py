"""`python -m engine.serve [MODEL]` (or `tp-runtime serve [MODEL]`): serve a model over an
OpenAI-compatible HTTP API, with vLLM's flags (`-tp 2`, `--model M`, `--dtype half`,
`--max-model-len 8k`, `--served-model-name a b`, ...).

With no MODEL it serves a built-in tiny demo model (random weights, a real tokenizer and
chat template), written once under `$TP_RUNTIME_CACHE/demo-model` (default
`~/.cache/tp-runtime`), so the whole stack can be tried with no download:

    python -m engine.serve --tp 2 --device cpu
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tp-runtime-demo", "prompt": "Hello", "max_tokens": 8}'

SIGINT / SIGTERM shut down gracefully: stop accepting, let in-flight requests finish for
up to --shutdown-timeout seconds (then abort them), stop every worker, exit 0. If a
worker dies, the worker group is replaced and its requests re-run (up to
--max-worker-restarts times in 10 minutes); past that, /health turns 503, pending
requests fail, and the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from config import DTYPES, PLACEMENT_STRATEGIES
from engine.entrypoints.demo_model import (
    DEMO_KV_CACHE_BYTES,
    DEMO_MODEL_NAME,
    ensure_demo_model,
)
from engine.entrypoints.torchrun import take_serving_role
from executor.registry import get_supported_executor_backends

logger = logging.getLogger("engine.serve")  # the command's name, as before the CLI moved here

GiB = 1 << 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '1G', '1.5G', '1.5GB' -> bytes (binary units); vLLM's '4k'
    (decimal, 10**3) and '4K' (binary, 2**10) spellings are read as vLLM reads them."""
    match = _HUMAN_INT.match(text.strip())
    if match and (match.group(2).islower() or "." not in match.group(1)):
        return human_readable_int(text)
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1073741824, 512MiB, 2GiB, 4G)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * (1 << (10 * " KMGT".index(unit or " "))))


_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT])$")


def human_readable_int(text: str) -> int:
    """vLLM's integer syntax: '2048'; '1k' / '25.6k' = 1000 / 25600 (k, m, g, t: powers of
    10); '1K' = 1024 (K, M, G, T: powers of 2, whole numbers only)."""
    value = text.strip()
    match = _HUMAN_INT.match(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (e.g. 2048, 2k, 2K)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 10 ** (3 * " kmgt".index(suffix)))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: decimals are not allowed with binary suffixes like {suffix}; did you mean "
            f"{number}{suffix.lower()}?")
    return int(number) * (1 << (10 * " KMGT".index(suffix)))


def max_model_len_arg(text: str) -> int | None:
    """--max-model-len: vLLM's integer syntax; 'auto' or -1: the model's own length
    (max_position_embeddings)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive token count, 'auto' or -1")
    return value


def port_arg(text: str) -> int:
    """--port: an integer in 0..65535 (0: any free port, reported in the banner)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range: a TCP port is in 0..65535")
    return port


def positive_int(text: str) -> int:
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents when `value` names a file, else `value` itself
    when it looks like a Jinja template (it has '{', '}' or a newline), as vLLM reads it.
    Raises ValueError for something path-like that is not a file."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # an inline template longer than a file name may be
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} looks like a path, but there is no such file")


class _RefuseRemoteCode(argparse.Action):
    """--trust-remote-code: a usage error (exit 2) as soon as it is parsed."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error("--trust-remote-code is refused: this server never runs code shipped with a checkpoint "
                     "(only tensors are loaded, and only the architectures it implements are served)")


UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def build_parser(prog: str = "python -m engine.serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="online weight quantisation (default none)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="accepted for vLLM compatibility: this runtime always runs eagerly (no CUDA graphs, no "
                        "torch.compile), so there is nothing to turn off")
    p.add_argument("--no-cpu-prepack-weights", dest="cpu_prepack_weights", action="store_false",
                   help="on CPU, do not keep a packed copy of the linear weights (saves their size in "
                        "memory, slower decode)")
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
    (argparse's convention). Sets `args.model` (positional or --model) and
    `args.served_model_names`."""
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
    if args.kv_cache_memory is not None and _device_is_cpu(args.device):
        import psutil

        ranks_here = args.tp if args.distributed_executor_backend != "external_launcher" else 1
        total = psutil.virtual_memory().total
        if args.kv_cache_memory * ranks_here > total:
            parser.error(
                f"--kv-cache-memory-bytes {args.kv_cache_memory} ({args.kv_cache_memory / GiB:.1f} GiB per rank, "
                f"x{ranks_here} rank(s) on this host) is more than this host's memory ({total / GiB:.1f} GiB)")
    args.uvicorn_log_level = args.uvicorn_log_level or args.log_level
    return args


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (before the model loads) so that a port
    in use fails at once; uvicorn listens on it later. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn does: a port whose old connections linger in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _Signals:
    """SIGINT/SIGTERM: during start-up they abort it (KeyboardInterrupt); while uvicorn
    serves, its own handlers stop the server and re-raise the signal afterwards, which
    lands here and is only noted, so shutdown continues and the exit code stays 0."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        self.received = signum
        if first and not self.serving:
            raise KeyboardInterrupt


async def _serve(server: Any, engine: Any, signals: _Signals, banner: str, sock: socket.socket) -> int:
    """Run uvicorn on `sock`; announce readiness; stop it when the engine dies. Returns the exit code."""
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    announced = died = stopping_anyway = False
    while not task.done():
        if server.started and not announced:
            announced = True
            print(banner, flush=True)
            if signals.received is not None:  # arrived before uvicorn took the signals over
                server.should_exit = True
        if engine.errored and not died:
            died = True
            if server.should_exit:
                # A stop was already under way: typically the signal went to the whole
                # process group (systemd, `kill -- -PGID`) and took the workers too.
                logger.warning("a worker died while the server was stopping: %s", engine.dead_error)
                stopping_anyway = True
            else:
                logger.error("the engine is dead (%s); shutting the server down", engine.dead_error)
                server.should_exit = True
        await asyncio.wait({task}, timeout=0.1)
    task.result()
    return 1 if died and not stopping_anyway else 0


def _device_is_cpu(device: str) -> bool:
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def _serves_http(args: argparse.Namespace) -> bool:
    """False on torchrun ranks > 0, which follow rank 0 and never listen."""
    return args.distributed_executor_backend != "external_launcher" or os.environ.get("RANK", "0") == "0"


def engine_config_kwargs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The EngineConfig keywords of a parsed command line."""
    # Unset on CPU, the resolved config gives each rank a fixed CPU_DEFAULT_KV_CACHE_BYTES; the
    # demo model needs far less.
    kv_bytes = args.kv_cache_memory
    if kv_bytes is None and args.model is None and args.gpu_memory_utilization is None and _device_is_cpu(args.device):
        kv_bytes = DEMO_KV_CACHE_BYTES
    return {
        "model": model, "tensor_parallel_size": args.tp, "dtype": args.dtype, "device": args.device,
        "load_format": args.load_format, "quantization": args.quantization, "revision": args.revision,
        "download_dir": args.download_dir, "seed": args.seed, "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size, "kv_cache_memory_bytes": kv_bytes, "async_scheduling": args.async_scheduling,
        "num_scheduler_steps": args.num_scheduler_steps,
        "gpu_memory_utilization": args.gpu_memory_utilization, "tokenizer": args.tokenizer,
        "cpu_prepack_weights": args.cpu_prepack_weights, "cpu_threads_bind": args.cpu_threads_bind,
        # The model in its own process even at TP=1, as vLLM's API server keeps its engine
        # core apart: in the server's process every model step shared the interpreter lock
        # with HTTP and detokenisation (bf16 TP=1 online, TPOT 38 -> 28-32 ms here).
        "distributed_executor_backend": args.distributed_executor_backend or "mp",
        "ray_placement_strategy": args.ray_placement_strategy,
        "enable_prefix_caching": args.enable_prefix_caching, "enable_sleep_mode": args.enable_sleep_mode,
        # torchrun started the ranks and only it could start them again.
        "max_worker_restarts": 0 if args.distributed_executor_backend == "external_launcher"
        else args.max_worker_restarts,
        "check_weights_finite": args.check_weights_finite,
    }


def main(argv: list[str] | None = None, prog: str = "python -m engine.serve") -> int:
    """The `python -m engine.serve` / `tp-runtime serve` command. Returns the exit code:
    0 when stopped by a signal (or interrupted during start-up), 1 when the port cannot
    be bound, the engine cannot start or it dies while serving; a bad flag exits 2
    before anything starts."""
    args = parse_args(argv, build_parser(prog))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signals = _Signals()
    sock: socket.socket | None = None
    try:
        if _serves_http(args):
            # Before the model loads: a port in use should not cost a model load to find out.
            try:
                sock = bind_socket(args.host, args.port)
            except OSError as e:
                logger.error("cannot listen on %s:%d (--host/--port): %s", args.host, args.port, e)
                return 1
        import uvicorn

        from engine.arg_utils import create_engine_config
        from engine.async_engine import AsyncEngine
        from engine.core import EngineCore
        from engine.entrypoints.openai.app import build_app
        from engine.metrics import EngineMetrics
        from engine.stat_logger import config_summary

        if args.model is None:
            model, names = str(ensure_demo_model()), args.served_model_name or [DEMO_MODEL_NAME]
        else:
            model, names = args.model, args.served_model_name or [args.model]
        config = create_engine_config(**engine_config_kwargs(args, model))
        logger.info("Initializing tp-runtime %s with config: %s, served_model_name=%s, enforce_eager=True",
                    package_version(), config_summary(config), names)
        core = EngineCore(config)
        if args.chat_template_text is not None:
            if core.tokenizer is None:
                core.shutdown()
                raise ValueError(f"--chat-template: {model} has no tokenizer to render a chat template with")
            core.tokenizer.chat_template = args.chat_template_text
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        if sock is not None:
            sock.close()
        return 0
    except Exception as e:
        logger.error("cannot start the engine: %s: %s", type(e).__name__, e)
        logger.debug("start-up failure", exc_info=True)
        if sock is not None:
            sock.close()
        return 1

    # Under torchrun (external_launcher) only rank 0 goes on to serve; the others follow it here.
    follower_exit_code = take_serving_role(core, args.shutdown_timeout)
    if follower_exit_code is not None:
        return follower_exit_code
    assert sock is not None
    metrics = EngineMetrics(names[0], config.scheduler_config.max_model_len)
    engine = AsyncEngine(core, metrics=metrics, log_stats=not args.disable_log_stats)
    exit_code = 1
    try:
        app = build_app(engine, names, api_key=args.api_key, generation_config=args.generation_config,
                        max_logprobs=args.max_logprobs, enable_log_requests=args.enable_log_requests,
                        max_log_len=args.max_log_len)
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=args.access_log,
            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off",
        ))
        signals.serving = True
        port = sock.getsockname()[1]  # the real one when --port 0
        exit_code = asyncio.run(_serve(server, engine, signals, f"Serving {names[0]} on http://{args.host}:{port}",
                                       sock))
    except KeyboardInterrupt:
        exit_code = 0
    except SystemExit as e:  # uvicorn exits like this when it cannot listen
        exit_code = e.code if isinstance(e.code, int) else 1
    finally:
        signals.serving = True
        engine.shutdown()
        sock.close()
    if exit_code == 0 and signals.received is not None:
        logger.info("stopped by %s", signal.Signals(signals.received).name)
    return exit_code


def package_version() -> str:
    """This package's installed version ("unknown" when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tp-runtime")
    except PackageNotFoundError:
        return "unknown"


def console_main(argv: list[str] | None = None) -> int:
    """The `tp-runtime` console script: `tp-runtime serve [MODEL] [flags]` runs `main`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: tp-runtime serve [MODEL] [flags]   (`tp-runtime serve --help` lists the flags)")
        return 0 if argv else 2
    if argv[0] == "--version":
        print(package_version())
        return 0
    if argv[0] != "serve":
        print(f"tp-runtime: unknown command {argv[0]!r}; the only command is `serve`", file=sys.stderr)
        return 2
    return main(argv[1:], prog="tp-runtime serve")
