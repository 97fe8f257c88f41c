"""Hub models: turn `MODEL` (a local path or a Hugging Face repo id) into a local directory.

Who calls this: the resolution step (`engine/arg_utils.py`), once, in the engine process, before any
worker starts; workers only ever see the local snapshot directory it returns.

- A path that exists locally (directory, or a single file such as a `.gguf`) is
  returned unchanged; so is anything that is not shaped like a repo id (the config
  then reports the missing directory).
- Otherwise `huggingface_hub.snapshot_download(repo_id, revision=..., cache_dir=
  download_dir, allow_patterns=..., ignore_patterns=...)` fetches config/tokenizer files
  (`weight_files.CONFIG_PATTERNS`) plus the load format's weight patterns
  (`weight_files.ALLOW_PATTERNS`; "auto"/"hf" narrow to safetensors when the repo has
  them; a format with no known patterns downloads everything). It runs under a
  cross-process `filelock.FileLock` at `<cache>/.locks/engine--models--org--name.lock`,
  so concurrent engines download once and the others then read the cache.
- Offline (`HF_HUB_OFFLINE=1`, read at call time from the environment and from
  `huggingface_hub.constants`): only the cache is used (`local_files_only=True`). When
  the cache lacks the repo, the revision, config.json or the weight files, the
  `ConfigError` says exactly that, naming the repo id, the revision and the cache dir.

The cache directory is `download_dir`, else `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
huggingface_hub's default — laid out as huggingface_hub lays it out
(`models--org--name/{blobs,refs/<branch>,snapshots/<commit>/...}`).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from pathlib import Path
from typing import Iterable

from config import ConfigError

logger = logging.getLogger(__name__)

_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REPO_ID_RE = re.compile(rf"^(?:{_REPO_PART}/)?{_REPO_PART}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_repo_id(model: str) -> bool:
    """`org/name` or `name`, as the Hub allows them (no path syntax, no `--` or `..`)."""
    return bool(_REPO_ID_RE.match(model)) and "--" not in model and ".." not in model


def is_offline() -> bool:
    """HF_HUB_OFFLINE, read now (the env var may be set after huggingface_hub was imported)."""
    from huggingface_hub import constants

    return bool(getattr(constants, "HF_HUB_OFFLINE", False)) or (
        os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE
    )


def hub_cache_dir(download_dir: str | None) -> Path:
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def weight_patterns_for(load_format: str) -> list[str] | None:
    """The weight-file patterns of `load_format` ([] for none, None when unknown)."""
    from model_loader.weight_files import ALLOW_PATTERNS

    patterns = ALLOW_PATTERNS.get(load_format)
    return list(patterns) if patterns is not None else None


def allow_patterns_for(load_format: str) -> list[str] | None:
    """Config/tokenizer patterns plus the format's weight patterns; None = everything."""
    from model_loader.weight_files import CONFIG_PATTERNS

    weights = weight_patterns_for(load_format)
    return None if weights is None else [*CONFIG_PATTERNS, *weights]


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _narrow_weight_patterns(
    repo_id: str, revision: str | None, weights: list[str], ignore_patterns: list[str]
) -> list[str]:
    """Online, with several candidate patterns ("auto"/"hf": safetensors, then .bin):
    keep only the first one the repo has, so a repo with both does not download both."""
    if len(weights) < 2:
        return weights
    try:
        from huggingface_hub import HfApi

        files = [f for f in HfApi().list_repo_files(repo_id, revision=revision) if not _matches(f, ignore_patterns)]
    except Exception as e:  # noqa: BLE001 - listing is an optimisation only
        logger.debug("could not list %s (%s); downloading every candidate weight pattern", repo_id, e)
        return weights
    for pattern in weights:
        if any(fnmatch.fnmatch(f, pattern) for f in files):
            return [pattern]
    return weights


def _hub_error(repo_id: str, revision: str | None, cache_dir: Path, offline: bool, error: Exception) -> ConfigError:
    try:
        import huggingface_hub.errors as hf_errors
    except ImportError:  # older huggingface_hub keeps them in utils
        import huggingface_hub.utils as hf_errors  # type: ignore[no-redef]

    rev = revision or "main"
    where = f"model={repo_id!r} (revision {rev!r}, Hub cache {cache_dir})"
    offline_hint = (
        "; HF_HUB_OFFLINE is set, so only the cache was searched and nothing was downloaded. Download it once "
        "with network access, or point download_dir / HF_HUB_CACHE at a cache that holds it"
    )

    def is_a(name: str) -> bool:
        cls = getattr(hf_errors, name, None)
        return cls is not None and isinstance(error, cls)

    if is_a("RevisionNotFoundError"):
        return ConfigError(f"{where}: revision {rev!r} does not exist in the repository: {error}")
    if is_a("RepositoryNotFoundError") or is_a("GatedRepoError"):
        return ConfigError(f"{where}: the repository is not found or not accessible (gated/private?): {error}")
    if is_a("IncompleteSnapshotError"):
        return ConfigError(f"{where}: the cached snapshot is incomplete: {error}" + (offline_hint if offline else ""))
    if is_a("LocalEntryNotFoundError"):
        what = "the cache has no snapshot of this repository at this revision"
        if offline:
            return ConfigError(f"{where}: {what}{offline_hint}")
        return ConfigError(f"{where}: {what}, and the Hub could not be reached: {error}")
    if is_a("HFValidationError"):
        return ConfigError(f"{where}: not a valid repo id or revision: {error}")
    return ConfigError(f"{where}: download failed: {type(error).__name__}: {error}")


def _check_snapshot(
    repo_id: str,
    revision: str | None,
    cache_dir: Path,
    snapshot: Path,
    load_format: str,
    ignore_patterns: list[str],
    offline: bool,
) -> None:
    """The snapshot must hold config.json and the format's weights; else say which is missing."""
    from model_loader.weight_files import TRAINING_FILES

    problems = []
    if load_format != "gguf" and not (snapshot / "config.json").is_file():
        problems.append("config.json")
    weights = weight_patterns_for(load_format)
    if weights:
        present = [
            p.name for p in snapshot.iterdir()
            if _matches(p.name, weights) and p.name not in TRAINING_FILES and not _matches(p.name, ignore_patterns)
        ]
        if not present:
            problems.append(f"weight files matching {weights} (load_format={load_format!r})")
    if not problems:
        return
    rev = revision or "main"
    message = (
        f"model={repo_id!r} (revision {rev!r}): the snapshot {snapshot} in the Hub cache {cache_dir} "
        f"lacks {' and '.join(problems)}"
    )
    if offline:
        message += (
            "; HF_HUB_OFFLINE is set, so nothing was downloaded. Download the files once with network access, "
            "or point download_dir / HF_HUB_CACHE at a cache that holds them"
        )
    else:
        message += " (the repository does not provide them at this revision)"
    raise ConfigError(message)


def resolve_model(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
    ignore_patterns: list[str] | None = None,
) -> str:
    """A local directory (or file) for `model`; see the module docstring. Raises ConfigError."""
    model = os.fspath(model)
    if os.path.exists(os.path.expanduser(model)):
        if revision is not None:
            logger.debug("model=%r is a local path; revision=%r is ignored", model, revision)
        return model
    if not looks_like_repo_id(model):
        return model  # not a repo id: the config reports the missing local path
    import huggingface_hub
    from filelock import FileLock

    ignore = list(ignore_patterns or [])
    offline = is_offline()
    cache_dir = hub_cache_dir(download_dir)
    allow = allow_patterns_for(load_format)
    if allow is not None and not offline:
        from model_loader.weight_files import CONFIG_PATTERNS

        weights = _narrow_weight_patterns(model, revision, weight_patterns_for(load_format) or [], ignore)
        allow = [*CONFIG_PATTERNS, *weights]

    lock_path = cache_dir / ".locks" / f"engine--{repo_folder_name(model)}.lock"
    lock: FileLock | None = None
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path))
        lock.acquire()
    except OSError as e:
        if not offline:
            raise ConfigError(
                f"model={model!r}: cannot take the download lock {lock_path} in the Hub cache: {e}"
            ) from e
        lock = None  # a read-only cache is fine when nothing will be written
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id=model,
            revision=revision,
            cache_dir=str(cache_dir),
            allow_patterns=allow,
            ignore_patterns=ignore or None,
            local_files_only=offline,
        )
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear ConfigError
        raise _hub_error(model, revision, cache_dir, offline, e) from e
    finally:
        if lock is not None:
            lock.release()
    snapshot_dir = Path(snapshot)
    _check_snapshot(model, revision, cache_dir, snapshot_dir, load_format, ignore, offline)
    logger.info("model %r (revision %s) resolved to %s", model, revision or "main", snapshot_dir)
    return str(snapshot_dir)
