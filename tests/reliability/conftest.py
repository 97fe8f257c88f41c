"""Fixtures of the reliability suite: a private, watched temp directory."""

from __future__ import annotations

import multiprocessing.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.helpers import short_tmpdir


@pytest.fixture
def private_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty directory (short path: sockets live under it) that this process's new
    temp files, and every child it starts, use as the temp directory, so a test can
    assert the engine left nothing there. (This interpreter's multiprocessing temp dir,
    where its forkserver and engines keep their sockets, was made earlier, elsewhere.)"""
    # This interpreter's multiprocessing temp dir (its forkserver's socket and the
    # engines' private directories) is made once and kept for its life: not in here.
    multiprocessing.util.get_temp_dir()
    root = short_tmpdir()
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)
