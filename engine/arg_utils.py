"""The resolution step: an EngineConfig checked against the outside world, once.

`create_engine_config(config)` (vLLM's `EngineArgs.create_engine_config`) is run by
`EngineCore` in the engine process before any worker starts, and by `engine.serve`
before it loads anything; workers only ever receive its result. It does everything
that `EngineConfig`'s constructor may not:

- a `.gguf` file with load_format "auto" is read as "gguf";
- load_format, quantization and distributed_executor_backend are looked up in their
  registries (user registrations included);
- device "auto" becomes "cuda" where torch sees a GPU, else "cpu";
- on the CPU, `cpu_threads_bind` is checked against the cores this process may use;
- the TP communicator, the attention backend and the CUDA graph sizes are chosen for
  the device (and refused where they cannot run there);
- a Hub repo id becomes a local snapshot directory (downloaded once, under a file
  lock: engine/hub.py);
- config.json (or the GGUF header) is read and checked, the dtype and max_model_len
  derived, and the TP size checked against the model's heads.

Every failure is a ConfigError naming the field, value or file at fault. The input is
not modified: the result is a copy with `model` the local path and the sub-configs set.
A config that is already resolved comes back as it is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from config import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    ConfigError,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from config.compilation import DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE, default_capture_sizes
from config.utils import check_choice, check_positive
from distributed.utils import divide, kv_heads_per_rank
from engine.hub import resolve_model
from executor.registry import get_supported_executor_backends
from model_loader.gguf_quant import check_gguf_tensor_parallel
from model_loader.gguf_utils import find_gguf_file, gguf_hf_config
from model_loader.registry import get_supported_load_formats
from models.errors import UnsupportedArchitectureError
from models.layers.quantization import ONLINE_QUANTIZATION_METHODS, QUANTIZATION_METHODS, get_quantization_config
from models.registry import ModelRegistry
from worker.cpu_affinity import CpuBindError, allowed_cpus, cpu_binds

_MAX_CONFIG_BYTES = 64 << 20  # config.json is a few KiB; a larger file is not a config


def create_engine_config(config: EngineConfig | None = None, /, **kwargs: Any) -> EngineConfig:
    """The resolved copy of `config` (or of `EngineConfig(**kwargs)`); see the module
    docstring. Raises ConfigError; TypeError for both a config and keywords."""
    if config is None:
        config = EngineConfig(**kwargs)
    elif kwargs:
        raise TypeError("pass either an EngineConfig or keywords, not both")
    if config.is_resolved:
        return config
    load_format = config.load_format
    if load_format == "auto" and config.model.endswith(".gguf") and os.path.isfile(config.model):
        load_format = "gguf"  # a single GGUF file can only be read one way
    check_choice("load_format", load_format, tuple(get_supported_load_formats()))
    check_choice("quantization", config.quantization, (None, *QUANTIZATION_METHODS))
    backend = config.distributed_executor_backend
    if backend is not None and not isinstance(backend, type):
        check_choice("distributed_executor_backend", backend, tuple(get_supported_executor_backends()))

    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        _check_cpu_binds(config)
    tp_communicator = _tp_communicator(config, device, backend)
    attention_backend = _attention_backend(config, device)
    load_config = LoadConfig(
        load_format=load_format,
        download_dir=config.download_dir,
        safetensors_load_strategy=config.safetensors_load_strategy,
        safetensors_prefetch_num_threads=config.safetensors_prefetch_num_threads,
        safetensors_prefetch_block_size=config.safetensors_prefetch_block_size,
        model_loader_extra_config=dict(config.model_loader_extra_config or {}),
        ignore_patterns=list(config.ignore_patterns) if config.ignore_patterns is not None else ["original/**/*"],
        use_tqdm_on_load=config.use_tqdm_on_load,
        check_weights_finite=bool(config.check_weights_finite),
    )
    # A Hub repo id is resolved here, once, in the engine process (download or cache
    # lookup under a file lock, honouring revision / download_dir / ignore_patterns):
    # workers receive the local snapshot directory. Local paths come back unchanged.
    model = resolve_model(config.model, config.revision, config.download_dir, load_format,
                          load_config.ignore_patterns)
    resolved = dataclasses.replace(config, model=model, load_format=load_format)
    model_config = _model_config(resolved)
    _check_parallel_fits_model(resolved, model_config)

    kv_bytes = config.kv_cache_memory_bytes
    if (device == "cpu" and kv_bytes is None and config.gpu_memory_utilization is None
            and config.num_gpu_blocks_override is None):
        kv_bytes = CPU_DEFAULT_KV_CACHE_BYTES
    max_len = model_config.max_model_len
    batched = config.max_num_batched_tokens if config.max_num_batched_tokens is not None else max(max_len, 2048)
    check_positive("max_num_batched_tokens", batched)

    resolved.model_config = model_config
    resolved.parallel_config = ParallelConfig(config.tensor_parallel_size, backend, config.ray_placement_strategy,
                                              tp_communicator, bool(config.enable_expert_parallel))
    resolved.load_config = load_config
    resolved.cache_config = CacheConfig(
        config.block_size, 0.9 if config.gpu_memory_utilization is None else config.gpu_memory_utilization,
        kv_bytes, config.num_gpu_blocks_override, bool(config.enable_prefix_caching),
    )
    resolved.device_config = DeviceConfig(device, bool(config.cpu_prepack_weights), config.cpu_threads_bind)
    resolved.scheduler_config = SchedulerConfig(config.max_num_seqs, batched, max_len, config.async_scheduling,
                                                config.num_scheduler_steps)
    resolved.attention_config = AttentionConfig(attention_backend)
    resolved.compilation_config = _compilation_config(config, device, attention_backend, tp_communicator)
    return resolved


def _tp_communicator(config: EngineConfig, device: str, executor_backend: str | type | None) -> str:
    """"auto" as NCCL on CUDA and gloo on the CPU; NCCL refused on the CPU, and where the
    ranks this host starts outnumber its GPUs (NCCL cannot put two ranks on one device)."""
    choice = config.tp_communicator
    if choice == "auto":
        choice = "nccl" if device == "cuda" else "gloo"
    if choice == "nccl" and device != "cuda":
        raise ConfigError(f"tp_communicator='nccl' needs device='cuda' (device is {device!r}); use 'gloo' or 'auto'")
    ranks_here = config.tensor_parallel_size if executor_backend in (None, "mp", "uni") else 1
    if choice == "nccl" and ranks_here > 1 and ranks_here > torch.cuda.device_count():
        raise ConfigError(
            f"tensor_parallel_size={config.tensor_parallel_size} needs {ranks_here} GPUs with tp_communicator="
            f"{config.tp_communicator!r} (NCCL), but {torch.cuda.device_count()} are visible; "
            "tp_communicator='gloo' lets the ranks share a GPU"
        )
    return choice


def _attention_backend(config: EngineConfig, device: str) -> str:
    """The backend asked for, or the device's default: TRITON_ATTN on CUDA (TORCH_SDPA
    where Triton is not installed), CPU_ATTN on the CPU. Refuses a backend that cannot
    run on the device; never falls back silently."""
    name = config.attention_backend
    has_triton = importlib.util.find_spec("triton") is not None
    if name is None:
        return ("TRITON_ATTN" if has_triton else "TORCH_SDPA") if device == "cuda" else "CPU_ATTN"
    if name == "CPU_ATTN" and device != "cpu":
        raise ConfigError(f"attention_backend='CPU_ATTN' runs on the CPU only (device is {device!r})")
    if name == "TRITON_ATTN":
        if not has_triton:
            raise ConfigError("attention_backend='TRITON_ATTN' needs the triton package, which is not installed")
        if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                "attention_backend='TRITON_ATTN' on the CPU runs only under Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment, or use CPU_ATTN or TORCH_SDPA"
            )
    return name


def _compilation_config(config: EngineConfig, device: str, attention_backend: str,
                        tp_communicator: str) -> CompilationConfig:
    """CUDA graphs only where they can be captured: on CUDA, with TRITON_ATTN (whose
    kernels read every step's lengths from device buffers) and NCCL or no collectives
    (gloo stages through the host). Sizes sorted, deduplicated, and capped at
    max_num_seqs, the largest decode batch. On the CPU, its graphs (worker/cpu_graph.py)
    with CPU_ATTN, for batches up to max_num_seqs (and max_cudagraph_capture_size, when
    given)."""
    if not config.enforce_eager and device == "cpu" and attention_backend == "CPU_ATTN":
        ceiling = config.max_cudagraph_capture_size or DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE
        return CompilationConfig(enforce_eager=False, cpu_graph_max_batch=min(ceiling, config.max_num_seqs))
    graphs = (not config.enforce_eager and device == "cuda" and attention_backend == "TRITON_ATTN"
              and (tp_communicator == "nccl" or config.tensor_parallel_size == 1))
    if not graphs:
        return CompilationConfig(enforce_eager=True)
    if config.cudagraph_capture_sizes is not None:
        sizes = sorted({s for s in config.cudagraph_capture_sizes if s <= config.max_num_seqs})
        if config.max_cudagraph_capture_size is not None:
            sizes = [s for s in sizes if s <= config.max_cudagraph_capture_size]
    else:
        ceiling = config.max_cudagraph_capture_size or DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE
        sizes = default_capture_sizes(min(ceiling, config.max_num_seqs))
    return CompilationConfig(enforce_eager=not sizes, cudagraph_capture_sizes=sizes)


def _check_cpu_binds(config: EngineConfig) -> None:
    """`cpu_threads_bind` against the cores this process may use, for the ranks that
    share this host: all of them, except under torchrun, which says how many it
    started here."""
    ranks_here = config.tensor_parallel_size
    if config.distributed_executor_backend == "external_launcher" \
            and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        ranks_here = int(os.environ["LOCAL_WORLD_SIZE"])
    try:
        cpu_binds(config.cpu_threads_bind, ranks_here, allowed_cpus())
    except CpuBindError as e:
        raise ConfigError(str(e)) from None


def read_hf_config(model_dir: Path) -> SimpleNamespace:
    """Parse `model_dir/config.json` into attribute access; transformers is never imported,
    and nothing in it is run (`auto_map` and other remote-code keys are plain data here).
    Raises ConfigError naming the file when it is missing, too large, not UTF-8 JSON, or
    not an object; `ModelConfig.from_hf_config` checks the fields."""
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


def _model_config(config: EngineConfig) -> ModelConfig:
    """The model's config from the GGUF metadata (load_format "gguf") or config.json."""
    if config.load_format == "gguf":
        source = find_gguf_file(config.model)
        hf_config = gguf_hf_config(source)
    elif not Path(config.model).is_dir():
        raise ConfigError(f"model={config.model!r} is not a local directory")
    else:
        hf_config = read_hf_config(Path(config.model))
        source = Path(config.model) / "config.json"
    quantization = _quantization(config, hf_config, source)
    if quantization == "gguf":
        try:
            check_gguf_tensor_parallel(hf_config, config.tensor_parallel_size)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    return ModelConfig.from_hf_config(
        config.model, hf_config, source, dtype=config.dtype, max_model_len=config.max_model_len, seed=config.seed,
        revision=config.revision, quantization=quantization,
    )


# Files older quantisers write beside config.json, and the method each implies.
_QUANT_CONFIG_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def _quantization(config: EngineConfig, hf_config: SimpleNamespace, source: Path) -> str | None:
    """The quantisation method: the checkpoint's (config.json's `quantization_config`,
    else AutoGPTQ's quantize_config.json or AutoAWQ's quant_config.json beside it, copied
    into `hf_config.quantization_config` so that every worker sees it), else
    `config.quantization` (online). Checked here, once, by building the method's config:
    a ConfigError names the file and the field and value no method serves, or a
    `quantization` that contradicts the checkpoint's."""
    hf_quant = getattr(hf_config, "quantization_config", None)
    if hf_quant is None and source.name == "config.json":
        for file_name, method in _QUANT_CONFIG_FILES:
            path = source.parent / file_name
            if path.is_file():
                try:
                    hf_quant = {"quant_method": method, **json.loads(path.read_text(encoding="utf-8"))}
                except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise ConfigError(f"cannot parse {path}: {e}") from None
                source = path
                break
    if hf_quant is None:
        if config.quantization not in (None, *ONLINE_QUANTIZATION_METHODS):
            raise ConfigError(f"quantization={config.quantization!r} reads a checkpoint quantised with it, but "
                              f"{source} has no quantization_config; online quantisation supports "
                              f"{list(ONLINE_QUANTIZATION_METHODS)}")
        return config.quantization
    if not isinstance(hf_quant, dict):
        raise ConfigError(f"{source}: quantization_config must be a JSON object, got {hf_quant!r}")
    method = hf_quant.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ConfigError(f"{source}: quantization_config.quant_method={method!r} is not supported; "
                          f"supported: {list(QUANTIZATION_METHODS)}")
    if config.quantization is not None and config.quantization != method:
        raise ConfigError(f"quantization={config.quantization!r} contradicts the checkpoint, which {source} says is "
                          f"quantised with quant_method={method!r}; leave quantization unset")
    try:
        quant_config = get_quantization_config(method, hf_quant)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    is_moe = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if is_moe and (reason := quant_config.moe_unsupported_reason(_expert_checkpoint_names(hf_config))) is not None:
        raise ConfigError(f"{source}: this quantised mixture-of-experts checkpoint is not supported "
                          f"(quantization_config.quant_method={method!r}): {reason}")
    hf_config.quantization_config = hf_quant
    return method


def _expert_checkpoint_names(hf_config: Any) -> list[list[str]] | None:
    """Expert 0's projection names in each sparse layer, from the architecture's class
    (models/moe_utils.py), for a quantisation config that places experts by name; None
    where the architecture is not ours or config.json lacks num_hidden_layers (the model
    loader refuses them, naming them)."""
    try:
        model_cls, _ = ModelRegistry.resolve_model_cls(list(getattr(hf_config, "architectures", None) or []))
    except UnsupportedArchitectureError:
        return None
    names = getattr(model_cls, "expert_checkpoint_names", None)
    layers = getattr(hf_config, "num_hidden_layers", None)
    return names(hf_config) if names is not None and isinstance(layers, int) else None


def _check_parallel_fits_model(config: EngineConfig, model_config: ModelConfig) -> None:
    """The layers' own splitting rules (distributed.utils), applied before any worker
    starts so that a bad TP size is a ConfigError here, not a failure on every rank."""
    tp = config.tensor_parallel_size
    heads = model_config.num_attention_heads
    kv_heads = model_config.num_kv_heads
    try:
        divide(heads, tp, "num_attention_heads")
    except ValueError:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide num_attention_heads={heads} of {config.model}"
        ) from None
    try:
        kv_heads_per_rank(kv_heads, tp)
    except ValueError:
        raise ConfigError(
            f"tensor_parallel_size={tp} and num_key_value_heads={kv_heads} of {config.model} are incompatible: "
            "one must be a multiple of the other"
        ) from None
    hf = model_config.hf_config
    num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
    if not num_experts:  # a dense model: enable_expert_parallel changes nothing (as in vLLM)
        return
    if config.enable_expert_parallel:
        if num_experts % tp:
            raise ConfigError(f"enable_expert_parallel: num_experts={num_experts} of {config.model} is not divisible "
                              f"by tensor_parallel_size={tp}")
        return
    expert_inter = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    if expert_inter % tp:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide the experts' intermediate size {expert_inter} "
                          f"of {config.model}; enable_expert_parallel=True places whole experts instead")
