"""The built-in demo model `python -m engine.serve` serves when given no MODEL: a tiny
random llama with a real tokenizer and chat template, written once under
`$TP_RUNTIME_CACHE/demo-model` (default `~/.cache/tp-runtime`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("engine.serve")  # the command's name, as in its other log lines

MiB = 1 << 20
DEMO_KV_CACHE_BYTES = 64 * MiB
DEMO_MODEL_NAME = "tp-runtime-demo"
DEMO_MODEL_SPEC: dict[str, Any] = dict(
    arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, init_std=0.1, seed=0, num_shards=1,
)
_DEMO_MARKER = "tp-runtime-demo.json"


def cache_root() -> Path:
    """$TP_RUNTIME_CACHE, else ~/.cache/tp-runtime."""
    return Path(os.environ.get("TP_RUNTIME_CACHE") or Path.home() / ".cache" / "tp-runtime")


def ensure_demo_model() -> Path:
    """The demo checkpoint, generated on first use (under a file lock, written to a
    temporary directory and renamed, so a crash never leaves a half-written model)."""
    from filelock import FileLock

    from engine.tiny_model import make_tiny_model

    root = cache_root()
    target = root / "demo-model"
    marker = target / _DEMO_MARKER

    def is_current() -> bool:
        return marker.is_file() and json.loads(marker.read_text()) == DEMO_MODEL_SPEC

    if is_current():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "demo-model.lock")):
        if not is_current():
            logger.info("writing the demo model to %s", target)
            tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=root))
            spec = dict(DEMO_MODEL_SPEC)
            make_tiny_model(tmp, spec.pop("arch"), **spec)
            (tmp / _DEMO_MARKER).write_text(json.dumps(DEMO_MODEL_SPEC))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
    return target
