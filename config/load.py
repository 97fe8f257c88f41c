"""LoadConfig: how the weights are read (model_loader/ picks a loader by load_format)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
SAFETENSORS_LOAD_STRATEGIES = (None, "lazy", "eager", "prefetch")


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
