"""Fixtures of the reliability suite: a private, watched temp directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty directory that this process (and every child it starts) uses as its temp
    directory, so a test can assert the engine left nothing there."""
    root = tmp_path / "engine_tmp"
    root.mkdir()
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root
