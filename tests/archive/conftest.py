"""Fixtures over the synthetic archive of synthetic_archive.py, each test run against a local folder and against
the S3 server (a fresh prefix of its bucket): the same assertions hold for both."""

from __future__ import annotations

import uuid

import pytest
from archive_files import copy
from synthetic_archive import build_archive


@pytest.fixture(scope="session", params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def new_root(backend: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """new_root(name) -> an empty archive root: a new folder, or a new prefix of the S3 server's bucket."""

    def make(name: str) -> str:
        if backend == "local":
            return str(tmp_path_factory.mktemp(name))
        return f"s3://{request.getfixturevalue('s3_server').bucket}/{name}-{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture
def root(new_root) -> str:
    return new_root("archive")


@pytest.fixture(scope="session")
def shared_archive(new_root) -> str:
    """Built once per backend; tests that only read share it."""
    return build_archive(new_root("shared"))


@pytest.fixture
def archive(shared_archive: str, root: str) -> str:
    """A private copy, for tests that write (verdicts, rewritten shards)."""
    copy(shared_archive, root)
    return root
