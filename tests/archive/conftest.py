"""Fixtures over the synthetic archive of synthetic_archive.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from synthetic_archive import build_archive


@pytest.fixture(scope="session")
def shared_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once; tests that only read share it."""
    return build_archive(tmp_path_factory.mktemp("archive"))


@pytest.fixture
def archive(shared_archive: Path, tmp_path: Path) -> Path:
    """A private copy, for tests that write (verdicts, rewritten shards)."""
    return Path(shutil.copytree(shared_archive, tmp_path / "archive"))
