"""Hub repo ids resolve to a local snapshot, once, in the engine process — all offline.

Each test builds a Hugging Face cache in tmp_path laid out the way huggingface_hub lays
it out (`models--org--name/{blobs/<sha256>, refs/<branch>, snapshots/<commit>/<file>
-> ../../blobs/<sha256>}`), points `download_dir` or HF_HUB_CACHE at it and sets
HF_HUB_OFFLINE=1, so nothing ever touches the network. The online path is checked with
`snapshot_download` / `HfApi.list_repo_files` replaced by fakes.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from config import ConfigError, EngineConfig
from engine.arg_utils import create_engine_config
from engine.hub import looks_like_repo_id, resolve_model
from model_loader import get_model
from tests.conftest import input_ids_for
from tests.tp_helpers import compute_logits_on_rank

REPO_ID = "tiny-org/tiny-llama"
COMMIT_MAIN = "a" * 40
COMMIT_DEV = "b" * 40


def add_snapshot(
    cache: Path, repo_id: str, commit: str, files: dict[str, Path | bytes], branch: str | None = "main"
) -> Path:
    """Put `files` into the cache as snapshot `commit` (blobs + relative symlinks), and
    point refs/<branch> at it. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
    if branch is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return snapshot


def model_files(model_dir: Path, weights: bool = True, config: bool = True) -> dict[str, Path]:
    out = {}
    for f in sorted(model_dir.iterdir()):
        is_weight = f.suffix == ".safetensors" or f.name.endswith(".index.json")
        if (is_weight and weights) or (not is_weight and config and f.suffix == ".json"):
            out[f.name] = f
    return out


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def hub_cache(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    """A cache holding REPO_ID at main (llama) and at branch dev (llama_v250)."""
    cache = tmp_path / "hf_cache"
    add_snapshot(cache, REPO_ID, COMMIT_MAIN, model_files(tiny_models["llama"]))
    add_snapshot(cache, REPO_ID, COMMIT_DEV, model_files(tiny_models["llama_v250"]), branch="dev")
    return cache


def logits(config: EngineConfig, vocab: int) -> torch.Tensor:
    return compute_logits_on_rank(get_model(config), input_ids_for("hub", vocab))


def test_repo_id_resolves_from_the_offline_cache(offline: None, hub_cache: Path, tiny_models: dict[str, Path]) -> None:
    config = create_engine_config(model=REPO_ID, download_dir=str(hub_cache), device="cpu", dtype="float32",
                                  use_tqdm_on_load=False)
    snapshot = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT_MAIN
    assert config.model == str(snapshot) == config.model_config.model
    assert config.model_config.vocab_size == 320
    local = create_engine_config(model=str(tiny_models["llama"]), device="cpu", dtype="float32", use_tqdm_on_load=False)
    assert torch.equal(logits(config, 320), logits(local, 320))
    # The cross-process lock lives in the cache dir, keyed by the repo id.
    assert (hub_cache / ".locks" / "engine--models--tiny-org--tiny-llama.lock").exists()


def test_hf_hub_cache_env_is_the_default_cache(
    offline: None, hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    config = create_engine_config(model=REPO_ID, device="cpu")
    assert config.model.startswith(str(hub_cache))


def test_revision_selects_the_snapshot(offline: None, hub_cache: Path) -> None:
    dev = create_engine_config(model=REPO_ID, revision="dev", download_dir=str(hub_cache), device="cpu",
                               dtype="float32", use_tqdm_on_load=False)
    assert dev.model.endswith(COMMIT_DEV) and dev.model_config.vocab_size == 250
    assert dev.model_config.revision == "dev"
    by_commit = create_engine_config(model=REPO_ID, revision=COMMIT_MAIN, download_dir=str(hub_cache), device="cpu")
    assert by_commit.model.endswith(COMMIT_MAIN) and by_commit.model_config.vocab_size == 320
    assert logits(dev, 250).shape == (input_ids_for("hub", 250).numel(), 250)

    with pytest.raises(ConfigError) as info:
        create_engine_config(model=REPO_ID, revision="nope", download_dir=str(hub_cache), device="cpu")
    message = str(info.value)
    assert REPO_ID in message and "'nope'" in message and str(hub_cache) in message and "HF_HUB_OFFLINE" in message


def test_missing_files_in_the_cache_are_named(offline: None, tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    # Not cached at all.
    with pytest.raises(ConfigError) as info:
        create_engine_config(model="someone/absent", download_dir=str(cache), device="cpu")
    message = str(info.value)
    assert "someone/absent" in message and str(cache) in message and "HF_HUB_OFFLINE" in message
    assert "no snapshot" in message

    # Cached config, no weights: the format's patterns are named.
    add_snapshot(cache, "org/config-only", COMMIT_MAIN, model_files(tiny_models["llama"], weights=False))
    with pytest.raises(ConfigError) as info:
        create_engine_config(model="org/config-only", download_dir=str(cache), device="cpu")
    message = str(info.value)
    assert "org/config-only" in message and str(cache) in message
    assert re.search(r"lacks weight files matching \['\*\.safetensors', '\*\.bin'\]", message), message
    # ... which is fine for the dummy format: it needs config.json only.
    config = create_engine_config(model="org/config-only", download_dir=str(cache), device="cpu", load_format="dummy")
    assert config.model.endswith(COMMIT_MAIN)

    # Weights but no config.json.
    add_snapshot(cache, "org/no-config", COMMIT_MAIN, model_files(tiny_models["llama"], config=False))
    with pytest.raises(ConfigError, match=r"org/no-config.*lacks config\.json"):
        create_engine_config(model="org/no-config", download_dir=str(cache), device="cpu")

    # safetensors in the cache, but load_format="pt" wants .pt/.bin files.
    add_snapshot(cache, REPO_ID, COMMIT_MAIN, model_files(tiny_models["llama"]))
    with pytest.raises(ConfigError, match=r"lacks weight files matching \['\*\.pt', '\*\.bin'\] \(load_format='pt'\)"):
        create_engine_config(model=REPO_ID, download_dir=str(cache), device="cpu", load_format="pt")


def test_local_paths_are_returned_unchanged(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    assert resolve_model(str(tiny_models["llama"]), revision="dev") == str(tiny_models["llama"])
    missing = str(tmp_path / "nope")
    assert resolve_model(missing) == missing  # not a repo id: the config reports the missing dir
    with pytest.raises(ConfigError, match=re.escape(missing)):
        create_engine_config(model=missing)
    assert looks_like_repo_id("meta-llama/Llama-3.2-1B") and looks_like_repo_id("gpt2")
    for bad in ("/abs/path", "./rel", "a/b/c", "org--x/y", "a/../b", "~/m", ""):
        assert not looks_like_repo_id(bad), bad


def test_snapshot_download_arguments(
    hub_cache: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is asked of huggingface_hub, offline and online (both faked: no network)."""
    import huggingface_hub
    from huggingface_hub import constants

    calls: list[dict[str, Any]] = []
    snapshot = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT_MAIN

    def fake_snapshot_download(**kwargs: Any) -> str:
        calls.append(kwargs)
        return str(snapshot)

    def fake_list_repo_files(self: Any, repo_id: str, revision: str | None = None, **kwargs: Any) -> list[str]:
        return ["config.json", "model.safetensors", "pytorch_model.bin", "original/consolidated.pth"]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", fake_list_repo_files)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    create_engine_config(model=REPO_ID, revision="dev", download_dir=str(hub_cache), load_format="safetensors",
                         ignore_patterns=["*.gguf"], device="cpu")
    call = calls.pop()
    assert call["repo_id"] == REPO_ID and call["revision"] == "dev" and call["cache_dir"] == str(hub_cache)
    assert call["local_files_only"] is True and call["ignore_patterns"] == ["*.gguf"]
    assert "*.safetensors" in call["allow_patterns"] and "*.bin" not in call["allow_patterns"]
    assert "*.json" in call["allow_patterns"] and "tokenizer.model" in call["allow_patterns"]

    # Online, "auto": the listing narrows the weights to safetensors (not both formats).
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    create_engine_config(model=REPO_ID, download_dir=str(hub_cache), device="cpu")
    call = calls.pop()
    assert call["local_files_only"] is False and call["revision"] is None
    assert "*.safetensors" in call["allow_patterns"] and "*.bin" not in call["allow_patterns"]
    assert call["ignore_patterns"] == ["original/**/*"]
    # sharded_state downloads the rank files; dummy no weights at all.
    create_engine_config(model=REPO_ID, download_dir=str(hub_cache), device="cpu", load_format="dummy")
    assert not any(p.endswith((".safetensors", ".bin")) for p in calls.pop()["allow_patterns"])
    with pytest.raises(ConfigError, match=r"lacks weight files matching \['model-rank-\*-part-\*\.safetensors'\]"):
        create_engine_config(model=REPO_ID, download_dir=str(hub_cache), device="cpu", load_format="sharded_state")
    assert "model-rank-*-part-*.safetensors" in calls.pop()["allow_patterns"]


def test_engine_workers_receive_the_local_snapshot(offline: None, hub_cache: Path) -> None:
    """Resolution happens once in the engine process; workers get the local path."""
    from engine.core import EngineCore

    with EngineCore(model=REPO_ID, download_dir=str(hub_cache), device="cpu", dtype="float32", max_model_len=32,
                    max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20, use_tqdm_on_load=False) as core:
        (worker_model,) = core.collective_rpc(lambda worker: worker.config.model)
        out = core.generate([[1, 2, 3]])
    assert worker_model.endswith(COMMIT_MAIN) and os.path.isdir(worker_model)
    assert len(out[0].token_ids) > 0
