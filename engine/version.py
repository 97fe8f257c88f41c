"""This package's version, as `GET /version`, `tp-runtime --version` and the start-up log
line give it (vLLM keeps `vllm/version.py`)."""

from __future__ import annotations


def package_version() -> str:
    """The installed distribution's version ("unknown" when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tp-runtime")
    except PackageNotFoundError:
        return "unknown"
