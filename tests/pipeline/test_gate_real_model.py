"""On SmolLM2, the gate passes KIVI-2 and fails a deliberately broken cache (2-bit per-token keys, R = 0) with an
interval that excludes no drop."""

from pathlib import Path

import pytest
import yaml

from pipeline.cli import gate
from pipeline.config import load_config
from pipeline.runner import run
from pipeline.store import Store

pytestmark = pytest.mark.slow

KIVI2, BROKEN = "kivi-k2v2-g32-r128", "kivi-k2v2-g32-r0-ktoken"
SMOKE_GATE = Path(__file__).resolve().parents[2] / "configs" / "gates" / "smoke.yaml"
# The shipped smoke rule for KIVI-2's fidelity, applied to every cache of the run.
RULE = {k: v for k, v in next(r for r in yaml.safe_load(SMOKE_GATE.read_text())["rules"] if r["name"] == "fidelity-kivi2").items()
        if k != "cache"}


def test_the_gate_passes_kivi2_and_fails_per_token_keys_without_residual(write_config, data_dir, tmp_path, ray_head, capsys):
    path = write_config(model={"spec": "smollm2-135m", "max_context": 1024}, caches=["kivi-2", "token-keys-2-r0"],
                        data_dir=str(data_dir), workloads={"fidelity": {"n": 4, "tokens": 384}},
                        ray={"address": ray_head[0], "num_actors": 1})
    config = load_config(path)
    summary = run(config, path.read_text(), run_id="gate-check", progress=False)
    every_cache = tmp_path / "every-cache.yaml"
    every_cache.write_text(yaml.safe_dump({"rules": [RULE]}))
    kivi2_only = tmp_path / "kivi2-only.yaml"
    kivi2_only.write_text(yaml.safe_dump({"rules": [{**RULE, "cache": KIVI2}]}))

    assert gate(summary.run_id, str(config.archive), kivi2_only, record=True) == 0
    assert gate(summary.run_id, str(config.archive), every_cache, record=True) == 1
    print(capsys.readouterr().out)  # the verdict tables, for the CI log
    with Store(config.archive) as store:
        verdicts = {r["cache"]: r for r in store.records(
            "SELECT cache, observed, ci_low, ci_high, n, passed FROM verdicts WHERE run_id = 'gate-check'")}
    assert verdicts[KIVI2]["passed"] and not verdicts[BROKEN]["passed"]
    broken = verdicts[BROKEN]  # observed: the drop in top-1 agreement, points, over 4 windows
    assert broken["n"] == 4 and 0 < broken["ci_low"] <= broken["observed"] <= broken["ci_high"]
    assert broken["ci_low"] > RULE["margin"]  # the regression test fails it: the whole interval past the margin
    assert broken["observed"] > verdicts[KIVI2]["observed"]
