"""The kernels as compiled for the H200 (sm_90, offline with Triton's bundled ptxas): quantize + pack without
spills and within the instruction counts that put it above 70% of the copy rate, decode fast tiles on tensor
cores within their instruction count (BENCHMARKS.md)."""

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict:
    """`python -m tools.sass --json` in a fresh interpreter: compiling needs JIT functions, which this test
    session's TRITON_INTERPRET=1 replaces."""
    path = tmp_path_factory.mktemp("sass") / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "tools.sass", "--json", str(path)], env=env, check=True, capture_output=True)
    return {row["case"]: row for row in json.loads(path.read_text())}


@pytest.mark.parametrize("case, most", [("2-bit channel", 13.0), ("2-bit token", 18.5), ("4-bit channel", 13.0), ("4-bit token", 18.0)])
def test_quantize_compiles_without_spills_within_its_instruction_count(rows, case, most):
    row = rows[case]
    assert row["spill_bytes"] == 0
    assert 0 < row["per_element"] <= most  # before min/max in the input dtype and packing by shift-and-add: 15.1-19.5
    if "channel" in case:
        assert row["mix"].get("HMNMX2", 0) > 0  # keys' min/max: two 16-bit elements per instruction


def test_decode_fast_tiles_run_on_tensor_cores_within_their_instruction_count(rows):
    row = rows["32/32 heads KIVI-2"]
    # codes as the left operand, two slices per mma tile: one HMMA per token of a 128-token tile (keys and values)
    assert 0 < row["mix"].get("HMMA", 0) <= 128
    # warp-instructions per (token, KV head): 17.5 at the time of writing; 27.9 with one code slice per dot
    assert 0 < row["per_token"] <= 19
