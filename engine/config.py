"""Typed engine configuration, validated once.

`EngineConfig` takes the flat keywords users know from vLLM and builds the grouped
sub-configs (`model_config`, `parallel_config`, `load_config`, `cache_config`,
`device_config`, `scheduler_config`). Every check runs in `__post_init__`; a bad value
raises `ConfigError` naming the field, the value and what is allowed. The whole object
is picklable and is sent to every worker process.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# The KV budget per rank on the CPU when neither kv_cache_memory_bytes nor
# gpu_memory_utilization is given: a fixed space like vLLM's CPU backend, never a share
# of host memory (0.9 of a shared host's RAM took 19.6 GB and 5 s of zeroing). The
# server (engine.serve) should use this same constant.
from worker.platform import CPU_DEFAULT_KV_CACHE_BYTES

MiB = 1 << 20
# How long a busy rank may show no sign of progress, or any rank no heartbeat, before
# the engine names it hung (EngineConfig.worker_liveness_timeout_s).
DEFAULT_WORKER_LIVENESS_TIMEOUT_S = 10.0

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
SAFETENSORS_LOAD_STRATEGIES = (None, "lazy", "eager", "prefetch")
QUANTIZATION_METHODS = (None, "fp8")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


def _choice(field_name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{field_name}={value!r} is not valid; allowed values: {list(allowed)}")


def _positive(field_name: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{field_name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def read_hf_config(model_dir: Path) -> SimpleNamespace:
    """Parse `model_dir/config.json` into attribute access; transformers is never imported,
    and nothing in it is run (`auto_map` and other remote-code keys are plain data here).
    Raises ConfigError naming the file when it is missing, too large, not UTF-8 JSON, or
    not an object; `_build_model_config` checks the fields."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"model={str(model_dir)!r}: no config.json found at {path}")
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise ConfigError(f"{path} is {size} bytes, over the {_MAX_CONFIG_BYTES >> 20} MiB a config.json may have")
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"cannot parse {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return SimpleNamespace(**raw)


_MAX_CONFIG_BYTES = 64 * MiB  # config.json is a few KiB; a larger file is not a config
# Fields every supported architecture reads, and optional ones checked when present.
_REQUIRED_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
# Larger than any real model's dimension, small enough that no allocation sized by it is attempted.
_MAX_DIM = (1 << 31) - 1


def check_hf_config(hf_config: SimpleNamespace, source: Path) -> None:
    """Refuse a model config that no model could be built from, before any worker
    starts: ConfigError naming `source` (config.json or the GGUF file), the field and
    its value. Required: `architectures` (a non-empty list of names) and the integer
    dimensions in `_REQUIRED_INT_FIELDS`; every dimension is an integer in [1, 2**31 - 1]
    (not a bool or float); the attention heads split evenly (num_key_value_heads divides
    num_attention_heads; without an explicit head_dim, num_attention_heads divides
    hidden_size); rope_theta and rms_norm_eps, when set, are positive numbers."""
    archs = getattr(hf_config, "architectures", None)
    if archs is None:
        raise ConfigError(f"{source} lacks the required key 'architectures'")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a for a in archs):
        raise ConfigError(f"{source}: architectures={archs!r} must be a non-empty list of architecture names")
    for key in _REQUIRED_INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(hf_config, key, None)
        if value is None:
            if key in _REQUIRED_INT_FIELDS:
                raise ConfigError(f"{source} lacks the required key {key!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}={value!r} must be an integer")
        if not 1 <= value <= _MAX_DIM:
            raise ConfigError(f"{source}: {key}={value!r} must be between 1 and {_MAX_DIM}")
    heads, hidden = hf_config.num_attention_heads, hf_config.hidden_size
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
        )
    if getattr(hf_config, "head_dim", None) is None and hidden % heads:
        raise ConfigError(
            f"{source}: num_attention_heads={heads} does not divide hidden_size={hidden} (and no head_dim is given)"
        )
    for key in ("rope_theta", "rms_norm_eps"):
        value = getattr(hf_config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ConfigError(f"{source}: {key}={value!r} must be a positive number")


@dataclass
class ModelConfig:
    model: str  # a local directory (resolved from a Hub id by the engine before workers start)
    dtype: torch.dtype
    hf_config: SimpleNamespace
    max_model_len: int
    seed: int = 0
    revision: str | None = None
    quantization: str | None = None

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None  # None -> "uni" at tp=1, else "mp"
    # "ray" only: PACK fills as few nodes as possible, SPREAD puts ranks on different nodes.
    ray_placement_strategy: str = "PACK"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass
class LoadConfig:
    load_format: str = "auto"
    download_dir: str | None = None
    safetensors_load_strategy: str | None = None  # None behaves as "lazy", with prefetch on network filesystems
    safetensors_prefetch_num_threads: int = 8
    safetensors_prefetch_block_size: int = 16 * MiB
    model_loader_extra_config: dict[str, Any] = field(default_factory=dict)
    ignore_patterns: list[str] = field(default_factory=lambda: ["original/**/*"])
    use_tqdm_on_load: bool = True
    # Scan every floating-point checkpoint tensor for NaN / Inf and warn naming it (costs one
    # more read of the checkpoint; model_loader/default_loader.py).
    check_weights_finite: bool = False


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # set: skip profiling and use this many bytes per rank
    num_gpu_blocks_override: int | None = None  # set: exactly this many blocks, no profiling (vLLM's knob)
    # Full KV blocks are named by a hash of their tokens and reused by later prompts
    # that start the same way (engine/block_manager.py); on by default, as in vLLM.
    enable_prefix_caching: bool = True


@dataclass
class DeviceConfig:
    device: str = "auto"
    # Linear weights on the CPU get a packed copy (models/layers/unquantized.py): faster
    # GEMMs (decode above all), more memory for the linear weights.
    cpu_prepack_weights: bool = True
    # Which cores each CPU rank runs on: "auto" | "none" | "0-3|4-7" (worker/cpu_affinity.py).
    cpu_threads_bind: str = "auto"

    @property
    def device_type(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # Plan step N+1 while step N runs (engine/core.py). None: wherever the executor
    # can (mp); True where it cannot is a ConfigError.
    async_scheduling: bool | None = None
    # Decode steps one scheduler output runs back to back (engine/scheduler.py).
    num_scheduler_steps: int = 1


@dataclass
class EngineConfig:
    """The one configuration object: flat keywords in, validated sub-configs out."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    seed: int = 0
    distributed_executor_backend: str | type | None = None
    ray_placement_strategy: str = "PACK"
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

    model_config: ModelConfig = field(init=False)
    parallel_config: ParallelConfig = field(init=False)
    load_config: LoadConfig = field(init=False)
    cache_config: CacheConfig = field(init=False)
    device_config: DeviceConfig = field(init=False)
    scheduler_config: SchedulerConfig = field(init=False)

    def __post_init__(self) -> None:
        self.model = os.fspath(self.model)
        if self.load_format == "auto" and self.model.endswith(".gguf") and os.path.isfile(self.model):
            self.load_format = "gguf"  # a single GGUF file can only be read one way
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, ("auto", *_DTYPES))
        _choice("safetensors_load_strategy", self.safetensors_load_strategy, SAFETENSORS_LOAD_STRATEGIES)
        _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        from model_loader.registry import get_supported_load_formats

        _choice("load_format", self.load_format, tuple(get_supported_load_formats()))
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("safetensors_prefetch_num_threads", self.safetensors_prefetch_num_threads)
        _positive("safetensors_prefetch_block_size", self.safetensors_prefetch_block_size)
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        _positive("worker_liveness_timeout_s", self.worker_liveness_timeout_s, allow_zero=True)
        _positive("max_worker_restarts", self.max_worker_restarts, allow_zero=True)
        if self.max_worker_restarts and self.distributed_executor_backend == "external_launcher":
            raise ConfigError(
                f"max_worker_restarts={self.max_worker_restarts} needs an executor that starts its own workers; "
                "under distributed_executor_backend='external_launcher' torchrun owns the ranks: use 0"
            )
        _positive("worker_restart_window_s", self.worker_restart_window_s)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_gpu_blocks_override is not None:
            _positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        backend = self.distributed_executor_backend
        if backend is not None and not isinstance(backend, type):
            from executor.registry import get_supported_executor_backends

            _choice("distributed_executor_backend", backend, tuple(get_supported_executor_backends()))
        from executor.ray_utils import PLACEMENT_STRATEGIES  # light: Ray itself is imported only to run

        _choice("ray_placement_strategy", self.ray_placement_strategy, PLACEMENT_STRATEGIES)
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"distributed_executor_backend='uni' runs one in-process worker; "
                f"tensor_parallel_size={self.tensor_parallel_size} needs 'mp'"
            )

        self.device_config = DeviceConfig(self.device, bool(self.cpu_prepack_weights), self.cpu_threads_bind)
        if self.device_config.device_type == "cpu":
            from worker.cpu_affinity import CpuBindError, allowed_cpus, cpu_binds

            # The ranks that share this host's cores: all of them, except under torchrun,
            # which says how many it started here.
            ranks_here = self.tensor_parallel_size
            if backend == "external_launcher" and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
                ranks_here = int(os.environ["LOCAL_WORLD_SIZE"])
            try:
                cpu_binds(self.cpu_threads_bind, ranks_here, allowed_cpus())
            except CpuBindError as e:
                raise ConfigError(str(e)) from None
        self.parallel_config = ParallelConfig(self.tensor_parallel_size, backend, self.ray_placement_strategy)
        self.load_config = LoadConfig(
            load_format=self.load_format,
            download_dir=self.download_dir,
            safetensors_load_strategy=self.safetensors_load_strategy,
            safetensors_prefetch_num_threads=self.safetensors_prefetch_num_threads,
            safetensors_prefetch_block_size=self.safetensors_prefetch_block_size,
            model_loader_extra_config=dict(self.model_loader_extra_config or {}),
            ignore_patterns=list(self.ignore_patterns) if self.ignore_patterns is not None else ["original/**/*"],
            use_tqdm_on_load=self.use_tqdm_on_load,
            check_weights_finite=bool(self.check_weights_finite),
        )
        kv_bytes = self.kv_cache_memory_bytes
        if (self.device_config.device_type == "cpu" and kv_bytes is None and self.gpu_memory_utilization is None
                and self.num_gpu_blocks_override is None):
            kv_bytes = CPU_DEFAULT_KV_CACHE_BYTES
        self.cache_config = CacheConfig(
            self.block_size, 0.9 if self.gpu_memory_utilization is None else self.gpu_memory_utilization,
            kv_bytes, self.num_gpu_blocks_override, bool(self.enable_prefix_caching),
        )
        # A Hub repo id is resolved here, once, in the engine process (download or cache
        # lookup under a file lock, honouring revision / download_dir / ignore_patterns):
        # workers receive the local snapshot directory. Local paths come back unchanged.
        from engine.hub import resolve_model

        self.model = resolve_model(
            self.model, self.revision, self.download_dir, self.load_format, self.load_config.ignore_patterns
        )
        self.model_config = self._build_model_config()
        max_len = self.model_config.max_model_len
        batched = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else max(max_len, 2048)
        _positive("max_num_batched_tokens", batched)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling={self.async_scheduling!r} must be True, False or None (automatic)")
        if isinstance(self.num_scheduler_steps, bool) or not isinstance(self.num_scheduler_steps, int) \
                or self.num_scheduler_steps < 1:
            raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps!r} must be an integer >= 1")
        self.scheduler_config = SchedulerConfig(self.max_num_seqs, batched, max_len, self.async_scheduling,
                                                self.num_scheduler_steps)
        self._check_parallel_fits_model()

    def _build_model_config(self) -> ModelConfig:
        model_dir = Path(self.model)
        if self.load_format == "gguf":  # the config comes from the GGUF metadata, not config.json
            from model_loader.gguf_utils import find_gguf_file, gguf_hf_config

            model_dir = find_gguf_file(self.model)
            hf_config = gguf_hf_config(model_dir)
            source = model_dir
        elif not model_dir.is_dir():
            raise ConfigError(f"model={self.model!r} is not a local directory")
        else:
            hf_config = read_hf_config(model_dir)
            source = model_dir / "config.json"
        check_hf_config(hf_config, source)
        if self.dtype == "auto":
            ckpt_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or "float32"
            if not isinstance(ckpt_dtype, str) or ckpt_dtype not in _DTYPES:
                raise ConfigError(f"{source}: torch_dtype={ckpt_dtype!r} is not one of {list(_DTYPES)}")
            dtype = _DTYPES[ckpt_dtype]
        else:
            dtype = _DTYPES[self.dtype]
        max_positions = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_len = self.max_model_len if self.max_model_len is not None else max_positions
        if max_len < 2:
            raise ConfigError(f"max_model_len={max_len!r} must be >= 2 (one prompt token and one generated token)")
        if max_len > max_positions:
            raise ConfigError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings={max_positions}"
            )
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and getattr(hf_config, "use_sliding_window", True) and window < max_len:
            raise ConfigError(
                f"sliding_window={window} in {source} is shorter than max_model_len={max_len}; "
                "sliding-window attention is not supported, set max_model_len <= the window"
            )
        return ModelConfig(self.model, dtype, hf_config, max_len, self.seed, self.revision, self.quantization)

    def _check_parallel_fits_model(self) -> None:
        """The layers' own splitting rules (distributed.utils), applied before any worker
        starts so that a bad TP size is a ConfigError here, not a failure on every rank."""
        from distributed.utils import divide, kv_heads_per_rank

        tp = self.tensor_parallel_size
        heads = self.model_config.num_attention_heads
        kv_heads = self.model_config.num_kv_heads
        try:
            divide(heads, tp, "num_attention_heads")
        except ValueError:
            raise ConfigError(
                f"tensor_parallel_size={tp} does not divide num_attention_heads={heads} of {self.model}"
            ) from None
        try:
            kv_heads_per_rank(kv_heads, tp)
        except ValueError:
            raise ConfigError(
                f"tensor_parallel_size={tp} and num_key_value_heads={kv_heads} of {self.model} are incompatible: "
                "one must be a multiple of the other"
            ) from None
