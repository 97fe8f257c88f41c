"""`python -m engine.serve [MODEL]`: serve a model over an OpenAI-compatible HTTP API.

With no MODEL it serves a built-in tiny demo model (random weights, a real tokenizer and
chat template), written once under `$TP_RUNTIME_CACHE/demo-model` (default
`~/.cache/tp-runtime`), so the whole stack can be tried with no download:

    python -m engine.serve --tp 2 --device cpu
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tp-runtime-demo", "prompt": "Hello", "max_tokens": 8}'

SIGINT / SIGTERM shut down gracefully: stop accepting, let in-flight requests finish for
up to --shutdown-timeout seconds (then abort them), stop every worker, exit 0. If a
worker dies, /health turns 503, pending requests fail, and the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
from types import FrameType
from typing import Any

from engine.entrypoints.demo_model import DEMO_KV_CACHE_BYTES, DEMO_MODEL_NAME, ensure_demo_model
from engine.entrypoints.torchrun import take_serving_role
from executor.ray_utils import PLACEMENT_STRATEGIES
from executor.registry import get_supported_executor_backends

logger = logging.getLogger("engine.serve")  # the command's name, as before the CLI moved here

GiB = 1 << 30
CPU_DEFAULT_KV_CACHE_BYTES = 1 * GiB  # like vLLM's CPU backend: a fixed space, not a share of host RAM
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '1G', '1.5GB' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1073741824, 512MiB, 2GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * (1 << (10 * " KMGT".index(unit or " "))))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (a Hugging Face checkpoint); omit to serve the built-in demo model")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel size: one worker process per rank (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` name clients use (default: MODEL as given, or tp-runtime-demo)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weight and activation dtype (default auto: the checkpoint's)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto: cuda if available")
    p.add_argument("--load-format", default="auto", help="weight loader (default auto)")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="online weight quantisation (default none)")
    p.add_argument("--no-cpu-prepack-weights", dest="cpu_prepack_weights", action="store_false",
                   help="on CPU, do not keep a packed copy of the linear weights (saves their size in "
                        "memory, slower decode)")
    p.add_argument("--distributed-executor-backend", default=None, choices=get_supported_executor_backends(),
                   help="how ranks run: uni (in this process, TP=1 only), mp (one process per rank), "
                        "external_launcher (one torchrun process per rank; only rank 0 serves), "
                        "ray (one Ray actor per rank, see --ray-placement-strategy); default uni "
                        "at TP=1, mp above")
    p.add_argument("--ray-placement-strategy", default="PACK", choices=PLACEMENT_STRATEGIES,
                   help="with --distributed-executor-backend ray: PACK (the default) puts the ranks on as few nodes "
                        "as possible, SPREAD on different nodes; STRICT_ variants fail rather than do otherwise")
    p.add_argument("--cpu-threads-bind", default="auto", metavar="auto|none|CPUS",
                   help="on CPU, the cores of each rank: auto (split the available cores, the default), none, "
                        "or one cpu list per rank separated by '|', e.g. 0-3|4-7")
    p.add_argument("--revision", default=None, help="Hub revision when MODEL is a repo id")
    p.add_argument("--download-dir", default=None, help="Hub cache directory when MODEL is a repo id")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own (default 0)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="KV-cache bytes per rank, e.g. 2GiB (default: profiled with --gpu-memory-utilization on "
                        "CUDA; 1GiB on CPU; 64MiB for the demo model)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of earlier prompts that start the same way (default on)")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="add POST /sleep?level=N, POST /wake_up and GET /is_sleeping: free the KV cache and the "
                        "weights between phases (RL loops, shared hosts) and get them back without a restart")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the throughput, KV-cache and prefix-cache line every 10 s")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of device memory the engine may use when profiling (default 0.9)")
    p.add_argument("--api-key", default=os.environ.get("TP_RUNTIME_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $TP_RUNTIME_API_KEY, else none)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", dest="access_log", action="store_false", help="do not log every HTTP request")
    return p


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


async def _serve(server: Any, engine: Any, signals: _Signals, banner: str) -> int:
    """Run uvicorn; announce readiness; stop it when the engine dies. Returns the exit code."""
    task = asyncio.ensure_future(server.serve())
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


def main(argv: list[str] | None = None) -> int:
    """The `python -m engine.serve` command (engine/serve.py calls this). Returns the exit
    code: 0 when stopped by a signal (or interrupted during start-up), 1 when the engine
    cannot start or dies while serving, uvicorn's code when it cannot bind."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signals = _Signals()
    try:
        import uvicorn

        from engine.async_engine import AsyncEngine
        from engine.core import EngineCore
        from engine.entrypoints.openai.app import build_app

        if args.model is None:
            model, name = str(ensure_demo_model()), args.served_model_name or DEMO_MODEL_NAME
        else:
            model, name = args.model, args.served_model_name or args.model
        kv_bytes = args.kv_cache_memory
        if kv_bytes is None and _device_is_cpu(args.device):
            kv_bytes = DEMO_KV_CACHE_BYTES if args.model is None else CPU_DEFAULT_KV_CACHE_BYTES
        core = EngineCore(
            model=model, tensor_parallel_size=args.tp, dtype=args.dtype, device=args.device,
            load_format=args.load_format, quantization=args.quantization, revision=args.revision,
            download_dir=args.download_dir, seed=args.seed, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
            cpu_prepack_weights=args.cpu_prepack_weights, cpu_threads_bind=args.cpu_threads_bind,
            distributed_executor_backend=args.distributed_executor_backend,
            ray_placement_strategy=args.ray_placement_strategy,
            enable_prefix_caching=args.enable_prefix_caching, enable_sleep_mode=args.enable_sleep_mode,
        )
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        return 0
    except Exception as e:  # noqa: BLE001 - report it in one line, with the cause, and fail
        logger.error("cannot start the engine: %s: %s", type(e).__name__, e)
        logger.debug("start-up failure", exc_info=True)
        return 1

    # Under torchrun (external_launcher) only rank 0 goes on to serve; the others follow it here.
    follower_exit_code = take_serving_role(core, args.shutdown_timeout)
    if follower_exit_code is not None:
        return follower_exit_code
    engine = AsyncEngine(core, log_stats=not args.disable_log_stats)
    exit_code = 1
    try:
        app = build_app(engine, name, api_key=args.api_key)
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="off",
        ))
        signals.serving = True
        exit_code = asyncio.run(_serve(server, engine, signals, f"Serving {name} on http://{args.host}:{args.port}"))
    except KeyboardInterrupt:
        exit_code = 0
    except SystemExit as e:  # uvicorn exits like this when it cannot bind
        exit_code = e.code if isinstance(e.code, int) else 1
    finally:
        signals.serving = True
        engine.shutdown()
    if exit_code == 0 and signals.received is not None:
        logger.info("stopped by %s", signal.Signals(signals.received).name)
    return exit_code

