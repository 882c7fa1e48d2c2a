import json
import subprocess
import sys

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smollm2_at_2048_tokens_reproduces_the_papers_ordering(data_dir):
    """KIVI-4 < KIVI-2 < 2-bit per-token keys in KL to fp16, and per-token keys at least twice KIVI-2."""
    cmd = [sys.executable, "-m", "tools.fidelity", "--model", "smollm2-135m", "--tokens", "2048",
           "--data-dir", str(data_dir), "--json"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    rows = {r["config"]: r for r in json.loads(out)["rows"]}
    assert set(rows) == {"fp16", "kivi-4", "kivi-2", "kivi-2-r0", "token-keys-2"}
    kl = {name: r["mean_kl"] for name, r in rows.items()}
    assert kl["fp16"] == 0.0
    assert kl["kivi-4"] < kl["kivi-2"] < kl["token-keys-2"]
    assert kl["token-keys-2"] >= 2 * kl["kivi-2"]
    assert rows["kivi-2"]["kv_ratio"] < 0.22 < rows["kivi-4"]["kv_ratio"]
    assert rows["fp16"]["perplexity"] < rows["kivi-2"]["perplexity"]


def test_a_bad_preset_fails_before_the_model_loads():
    cmd = [sys.executable, "-m", "tools.fidelity", "--configs", "fp16,kivi2", "--text-file", "/nonexistent"]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode != 0
    assert "did you mean 'kivi-2'" in result.stderr
