"""The configuration: plain values and value checks, the lowest package.

Every layer names these types (the engine builds them, workers receive them pickled),
so this package imports nothing of ours and has no side effects: constructing a config
reads no file and probes nothing. The engine's resolution step
(`engine.arg_utils.create_engine_config`) fills in what needs the outside world.
"""

from config.attention import ATTENTION_BACKENDS, AttentionConfig
from config.cache import CPU_DEFAULT_KV_CACHE_BYTES, CacheConfig
from config.compilation import CompilationConfig
from config.device import DeviceConfig
from config.engine import DEFAULT_WORKER_LIVENESS_TIMEOUT_S, EngineConfig
from config.load import LoadConfig
from config.model import DTYPES, ModelConfig, check_hf_config
from config.parallel import PLACEMENT_STRATEGIES, ParallelConfig
from config.sampling_params import RequestOutputKind, SamplingParams
from config.scheduler import SchedulerConfig
from config.structured_outputs import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsConfig, StructuredOutputsParams
from config.utils import ConfigError

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionConfig",
    "CompilationConfig",
    "CPU_DEFAULT_KV_CACHE_BYTES",
    "CacheConfig",
    "ConfigError",
    "DEFAULT_WORKER_LIVENESS_TIMEOUT_S",
    "DTYPES",
    "DeviceConfig",
    "EngineConfig",
    "LoadConfig",
    "ModelConfig",
    "PLACEMENT_STRATEGIES",
    "ParallelConfig",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulerConfig",
    "STRUCTURED_OUTPUT_BACKENDS",
    "StructuredOutputsConfig",
    "StructuredOutputsParams",
    "check_hf_config",
]
