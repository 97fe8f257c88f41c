"""EngineConfig: vLLM's flat keywords, checked as values; the sub-configs once resolved.

`EngineConfig(model=..., tensor_parallel_size=2, ...)` takes the keywords users know
from vLLM and checks each value on its own (ranges, choices, types): a bad one raises
ConfigError naming the field, the value and what is allowed. Constructing it reads no
file, imports nothing of ours and probes nothing.

What needs the outside world (a Hub id turned into a local directory, config.json or a
GGUF header read, the device "auto" decided, the CPU binds checked against this host,
load formats and executor backends looked up in their registries) is the resolution
step, `engine.arg_utils.create_engine_config(config)`, which `EngineCore` runs before
any process starts (vLLM's `EngineArgs.create_engine_config`). It returns a copy whose
`model` is the local path and whose grouped sub-configs (`model_config`,
`parallel_config`, `load_config`, `cache_config`, `device_config`,
`scheduler_config`) are set; workers receive that copy, pickled. Reading a sub-config of
an unresolved config raises AttributeError saying so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from config.attention import ATTENTION_BACKENDS, AttentionConfig
from config.cache import CacheConfig
from config.compilation import CompilationConfig
from config.device import DEVICES, DeviceConfig
from config.load import SAFETENSORS_LOAD_STRATEGIES, LoadConfig, MiB
from config.model import DTYPES, ModelConfig
from config.parallel import PLACEMENT_STRATEGIES, TP_COMMUNICATORS, ParallelConfig
from config.scheduler import SchedulerConfig
from config.structured_outputs import StructuredOutputsConfig
from config.utils import ConfigError, check_choice, check_positive

# How long a busy rank may show no sign of progress, or any rank no heartbeat, before
# the engine names it hung (EngineConfig.worker_liveness_timeout_s).
DEFAULT_WORKER_LIVENESS_TIMEOUT_S = 10.0

RESOLVED_FIELDS = ("model_config", "parallel_config", "load_config", "cache_config", "device_config",
                   "scheduler_config", "attention_config", "compilation_config")


def _resolved_field() -> Any:
    # Set by the resolution step only: not an argument, not in repr or ==.
    return field(init=False, repr=False, compare=False)


@dataclass
class EngineConfig:
    """The one configuration object: flat keywords in, value-checked; sub-configs once
    resolved (see the module docstring)."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    seed: int = 0
    distributed_executor_backend: str | type | None = None
    ray_placement_strategy: str = "PACK"
    # config/parallel.py: TP_COMMUNICATORS. "gloo" on CUDA lets TP ranks share one GPU.
    tp_communicator: str = "auto"
    # Mixture-of-experts models: whole experts per rank instead of sliced ones (vLLM's flag).
    enable_expert_parallel: bool = False
    # config/attention.py: ATTENTION_BACKENDS, or None for the platform's default.
    attention_backend: str | None = None
    # CUDA graphs for decode steps (config/compilation.py), as vLLM's flags: off with
    # enforce_eager; None sizes: 1, 2, 4, 8, 16, ... up to max_cudagraph_capture_size
    # (default 512), never above max_num_seqs.
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    # vLLM's flag: plan each step while the one before it runs on the ranks, so they never
    # wait for the scheduler. None: on with the mp executor (the only one that runs
    # steps in the background); False: one step at a time.
    async_scheduling: bool | None = None
    # vLLM V0's --num-scheduler-steps: when every running request decodes and none waits,
    # one scheduler output runs up to this many decode steps on the ranks back to back,
    # each feeding its sampled tokens to the next, so the engine's own work (schedule,
    # send, collect, apply) and a rank's wait for it come once per that many tokens.
    # Outputs are the same tokens as with 1; a stop token wastes at most N - 1 steps of
    # that request's compute, and a request that arrives waits up to N steps to start.
    num_scheduler_steps: int = 1
    block_size: int = 16
    # None: 0.9 on CUDA; on the CPU, None (with no kv_cache_memory_bytes) means a fixed
    # CPU_DEFAULT_KV_CACHE_BYTES per rank, and a value given here asks for the share rule
    # (a profile run, then that share of this rank's part of host memory).
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Liveness (mp backend): a rank busy in a step with no progress (its main thread used
    # no CPU and entered no collective), or any rank whose heartbeat stopped, for this
    # many seconds is declared hung: the engine fails naming it instead of waiting for
    # the step timeout. 0 disables the check.
    worker_liveness_timeout_s: float = DEFAULT_WORKER_LIVENESS_TIMEOUT_S
    # Self-healing: a dead, hung or out-of-step rank makes the engine start a fresh worker
    # group and re-run the requests it was running from their tokens (as a recompute
    # preemption), up to this many times within worker_restart_window_s; past that, the
    # failure is raised as with 0 (the library's default: fail at once).
    max_worker_restarts: int = 0
    worker_restart_window_s: float = 600.0
    # EngineCore.sleep / wake_up (and engine.serve's /sleep routes), as vLLM's flag.
    enable_sleep_mode: bool = False
    download_dir: str | None = None
    revision: str | None = None
    quantization: str | None = None
    # A tokenizer directory other than the model's (vLLM's `tokenizer`); None: the model's.
    tokenizer: str | None = None
    safetensors_load_strategy: str | None = None
    safetensors_prefetch_num_threads: int = 8
    safetensors_prefetch_block_size: int = 16 * MiB
    model_loader_extra_config: dict[str, Any] | None = None
    ignore_patterns: list[str] | None = None
    use_tqdm_on_load: bool = True
    cpu_prepack_weights: bool = True
    cpu_threads_bind: str = "auto"
    # Warn, naming each tensor and its file, about checkpoint weights that hold NaN or Inf.
    check_weights_finite: bool = False
    # vLLM's --structured-outputs-config: the grammar backend ("auto" | "xgrammar") and the
    # default of every request's disable_any_whitespace; a dict converts.
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    model_config: ModelConfig = _resolved_field()
    parallel_config: ParallelConfig = _resolved_field()
    load_config: LoadConfig = _resolved_field()
    cache_config: CacheConfig = _resolved_field()
    device_config: DeviceConfig = _resolved_field()
    scheduler_config: SchedulerConfig = _resolved_field()
    attention_config: AttentionConfig = _resolved_field()
    compilation_config: CompilationConfig = _resolved_field()

    def __post_init__(self) -> None:
        self.model = os.fspath(self.model)
        check_positive("tensor_parallel_size", self.tensor_parallel_size)
        check_choice("device", self.device, DEVICES)
        check_choice("dtype", self.dtype, ("auto", *DTYPES))
        check_choice("safetensors_load_strategy", self.safetensors_load_strategy, SAFETENSORS_LOAD_STRATEGIES)
        check_positive("block_size", self.block_size)
        check_positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive("safetensors_prefetch_num_threads", self.safetensors_prefetch_num_threads)
        check_positive("safetensors_prefetch_block_size", self.safetensors_prefetch_block_size)
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        check_positive("worker_liveness_timeout_s", self.worker_liveness_timeout_s, allow_zero=True)
        check_positive("max_worker_restarts", self.max_worker_restarts, allow_zero=True)
        if self.max_worker_restarts and self.distributed_executor_backend == "external_launcher":
            raise ConfigError(
                f"max_worker_restarts={self.max_worker_restarts} needs an executor that starts its own workers; "
                "under distributed_executor_backend='external_launcher' torchrun owns the ranks: use 0"
            )
        check_positive("worker_restart_window_s", self.worker_restart_window_s)
        if self.kv_cache_memory_bytes is not None:
            check_positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_gpu_blocks_override is not None:
            check_positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        check_choice("ray_placement_strategy", self.ray_placement_strategy, PLACEMENT_STRATEGIES)
        check_choice("tp_communicator", self.tp_communicator, TP_COMMUNICATORS)
        check_choice("attention_backend", self.attention_backend, (None, *ATTENTION_BACKENDS))
        if self.max_cudagraph_capture_size is not None:
            check_positive("max_cudagraph_capture_size", self.max_cudagraph_capture_size)
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if not isinstance(sizes, (list, tuple)) or not all(
                    isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
                raise ConfigError(f"cudagraph_capture_sizes={sizes!r} must be a list of positive integers")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"distributed_executor_backend='uni' runs one in-process worker; "
                f"tensor_parallel_size={self.tensor_parallel_size} needs 'mp'"
            )
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling={self.async_scheduling!r} must be True, False or None (automatic)")
        if isinstance(self.num_scheduler_steps, bool) or not isinstance(self.num_scheduler_steps, int) \
                or self.num_scheduler_steps < 1:
            raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps!r} must be an integer >= 1")
        if isinstance(self.structured_outputs_config, dict):
            known = set(StructuredOutputsConfig.__dataclass_fields__)
            unknown = sorted(set(self.structured_outputs_config) - known)
            if unknown:
                raise ConfigError(f"structured_outputs_config has unknown key(s) {unknown}; known: {sorted(known)}")
            self.structured_outputs_config = StructuredOutputsConfig(**self.structured_outputs_config)
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            raise ConfigError(f"structured_outputs_config={self.structured_outputs_config!r} must be a "
                              "StructuredOutputsConfig or its dict")

    @property
    def is_resolved(self) -> bool:
        """Whether the resolution step set the sub-configs (and `model` is local)."""
        return "model_config" in self.__dict__

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not set: the sub-configs of an unresolved config.
        if name in RESOLVED_FIELDS:
            raise AttributeError(
                f"EngineConfig.{name} is set when the config is resolved: pass the config to EngineCore, or call "
                "engine.arg_utils.create_engine_config(config) first"
            )
        raise AttributeError(f"'EngineConfig' object has no attribute {name!r}")
