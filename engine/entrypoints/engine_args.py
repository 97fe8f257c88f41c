"""From `engine.serve`'s parsed flags to the engine's configuration (vLLM's
`EngineArgs.from_cli_args`): the `EngineConfig` keywords, and the choices the command
makes for the engine that a bare `EngineConfig` does not (the mp backend at TP=1, the
demo model's small KV cache, no restarts under torchrun).

Called by engine/entrypoints/cli.py `main`, in the server's process, before anything
loads; its result goes to `engine.arg_utils.create_engine_config`, which checks it
against the outside world. torch is imported only when the device is "auto" (to see
whether it has a GPU), never for `--help`.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.entrypoints.demo_model import DEMO_KV_CACHE_BYTES


def device_is_cpu(device: str) -> bool:
    """Whether --device (auto, cpu or cuda) runs the model on the CPU; "auto" asks torch."""
    if device == "auto":
        import torch

        return not torch.cuda.is_available()
    return device == "cpu"


def engine_config_kwargs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The EngineConfig keywords of a parsed command line (`cli_args.parse_args`), for
    the local model directory or Hub id `model`."""
    # Unset on CPU, the resolved config gives each rank a fixed CPU_DEFAULT_KV_CACHE_BYTES; the
    # demo model needs far less.
    kv_bytes = args.kv_cache_memory
    if kv_bytes is None and args.model is None and args.gpu_memory_utilization is None and device_is_cpu(args.device):
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
        "enforce_eager": args.enforce_eager, "cudagraph_capture_sizes": args.cudagraph_capture_sizes,
        "max_cudagraph_capture_size": args.max_cudagraph_capture_size,
        "attention_backend": args.attention_backend, "tp_communicator": args.tp_communicator,
        "enable_expert_parallel": args.enable_expert_parallel,
        "structured_outputs_config": args.structured_outputs_config or {},
    }
