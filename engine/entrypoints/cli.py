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
import signal
import socket
import sys

from engine.entrypoints.cli_args import build_parser, parse_args, serving_options
from engine.entrypoints.demo_model import DEMO_MODEL_NAME, ensure_demo_model
from engine.entrypoints.engine_args import engine_config_kwargs
from engine.entrypoints.launcher import ShutdownSignals, bind_socket, serve_http
from engine.entrypoints.torchrun import take_serving_role
from engine.version import package_version

logger = logging.getLogger("engine.serve")  # the command's name, as before the CLI moved here


def _serves_http(args: argparse.Namespace) -> bool:
    """False on torchrun ranks > 0, which follow rank 0 and never listen."""
    return args.distributed_executor_backend != "external_launcher" or os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None, prog: str = "python -m engine.serve") -> int:
    """The `python -m engine.serve` / `tp-runtime serve` command. Returns the exit code:
    0 when stopped by a signal (or interrupted during start-up), 1 when the port cannot
    be bound, the engine cannot start or it dies while serving; a bad flag exits 2
    before anything starts."""
    args = parse_args(argv, build_parser(prog, __doc__))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signals = ShutdownSignals()
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
        logger.info("Initializing tp-runtime %s with config: %s, served_model_name=%s",
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
                        max_log_len=args.max_log_len, **serving_options(args))
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=args.access_log,
            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off",
        ))
        signals.serving = True
        port = sock.getsockname()[1]  # the real one when --port 0
        banner = f"Serving {names[0]} on http://{args.host}:{port}"
        exit_code = asyncio.run(serve_http(server, engine, signals, banner, sock))
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
