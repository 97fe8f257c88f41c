"""The config package: value checks at construction, everything else in the resolution step.

`EngineConfig(...)` checks values only: it reads no file, downloads nothing, imports
nothing of ours and probes nothing. `engine.arg_utils.create_engine_config` does the
rest, once, before any process starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, EngineConfig
from engine.arg_utils import create_engine_config
from tests.runtime_helpers import live_children

REPO = Path(__file__).resolve().parents[1]


def test_importing_config_imports_nothing_of_ours_and_not_torch() -> None:
    code = (
        "import sys, config\n"
        "ours = {'engine', 'executor', 'worker', 'model_loader', 'models', 'distributed'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ours), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False", out.stdout


def test_constructing_a_config_touches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id, a missing directory, an unknown load format and a bind this host cannot
    give are all accepted by the constructor: none of them is a value error."""
    import huggingface_hub

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("EngineConfig(...) must not reach the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    cache = tmp_path / "hub-cache"
    config = EngineConfig(model="someone/never-downloaded", download_dir=str(cache), load_format="not-registered",
                          cpu_threads_bind="4000-4001", device="cpu")
    assert config.model == "someone/never-downloaded" and not cache.exists()
    assert EngineConfig(model=str(tmp_path / "absent")).model == str(tmp_path / "absent")
    assert not config.is_resolved


def test_unresolved_sub_configs_say_how_to_resolve(tiny_models: dict[str, Path]) -> None:
    config = EngineConfig(model=str(tiny_models["llama"]), device="cpu")
    with pytest.raises(AttributeError, match=r"create_engine_config"):
        config.model_config  # noqa: B018
    assert not hasattr(config, "scheduler_config")
    with pytest.raises(AttributeError, match="no attribute 'not_a_field'"):
        config.not_a_field  # type: ignore[attr-defined]  # noqa: B018


def test_resolution_returns_a_resolved_copy_once(tiny_models: dict[str, Path]) -> None:
    config = EngineConfig(model=str(tiny_models["llama"]), device="auto", max_num_seqs=7)
    resolved = create_engine_config(config)
    assert not config.is_resolved and resolved.is_resolved and resolved is not config
    assert resolved.device_config.device_type in ("cpu", "cuda") and config.device == "auto"
    assert resolved.scheduler_config.max_num_seqs == 7
    assert resolved.model_config.architectures == ["LlamaForCausalLM"]
    assert create_engine_config(resolved) is resolved
    with pytest.raises(TypeError, match="not both"):
        create_engine_config(config, max_num_seqs=3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"load_format": "not-registered"}, r"load_format='not-registered' is not valid"),
    ({"quantization": "int3"}, r"quantization='int3' is not valid"),
    ({"distributed_executor_backend": "nope"}, r"distributed_executor_backend='nope' is not valid"),
    ({"cpu_threads_bind": "4000-4001"}, r"4000"),
    ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 does not divide num_attention_heads"),
])
def test_resolution_errors_name_the_field_before_any_process_starts(
    tiny_models: dict[str, Path], kwargs: dict[str, object], message: str
) -> None:
    before = live_children()
    config = EngineConfig(model=str(tiny_models["llama"]), device="cpu", **kwargs)  # values are fine
    with pytest.raises(ConfigError, match=message):
        create_engine_config(config)
    assert live_children() == before


def test_value_errors_come_from_the_constructor() -> None:
    with pytest.raises(ConfigError, match=r"block_size=0 must be > 0"):
        EngineConfig(model="unused", block_size=0)
    with pytest.raises(ConfigError, match=r"dtype='int8' is not valid"):
        EngineConfig(model="unused", dtype="int8")
    with pytest.raises(ConfigError, match=r"ray_placement_strategy='CLOSE' is not valid"):
        EngineConfig(model="unused", ray_placement_strategy="CLOSE")
