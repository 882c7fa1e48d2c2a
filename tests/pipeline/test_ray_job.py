"""What CI proves end to end: the reduced smoke config submitted with `ray job submit` to a `ray start --head`
cluster, then the archive checked with DuckDB."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.store import Store

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_ci_config_submitted_as_a_ray_job_fills_the_archive(data_dir, tmp_path, ray_head):
    _, dashboard = ray_head
    config = yaml.safe_load((REPO_ROOT / "configs" / "ci.yaml").read_text())
    config.update(archive=str(tmp_path / "archive"), reports=str(tmp_path / "reports"), data_dir=str(data_dir),
                  gate=str(REPO_ROOT / "configs" / config["gate"]))
    path = tmp_path / "ci.yaml"
    path.write_text(yaml.safe_dump(config))
    ray = str(Path(sys.executable).with_name("ray"))
    job = subprocess.run(
        [ray, "job", "submit", "--address", dashboard, "--working-dir", str(REPO_ROOT), "--",
         "python", "-m", "jobs.nightly", "--config", str(path), "--run-id", "ci-job"],
        capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": dashboard}, timeout=1200,
    )
    assert "succeeded" in job.stdout, job.stdout[-3000:] + job.stderr[-3000:]

    with Store(tmp_path / "archive") as store:
        per_cache = store.records(
            "SELECT workload, cache, count(*) AS n, count(DISTINCT (task, request_id)) AS distinct_ids, count(error) AS errors "
            "FROM results WHERE run_id = 'ci-job' GROUP BY ALL ORDER BY ALL")
        status = store.records("SELECT status, kind FROM runs WHERE run_id = 'ci-job'")
        perf = store.records("SELECT cache, max(batch_size) AS max_batch FROM perf WHERE run_id = 'ci-job' GROUP BY ALL")
        verdicts = store.records("SELECT rule, passed FROM verdicts WHERE run_id = 'ci-job'")
    expected = {"gsm8k": 2, "longbench": 2, "niah": 2, "fidelity": 1}  # niah: one cell of each variant
    assert {(r["workload"], r["cache"]): r["n"] for r in per_cache} == {
        (w, c): n for w, n in expected.items() for c in ("fp16", "kivi-k2v2-g32-r128")}
    assert all(r["n"] == r["distinct_ids"] and r["errors"] == 0 for r in per_cache)
    assert status == [{"status": "complete", "kind": "nightly"}]
    assert {r["cache"] for r in perf} == {"fp16", "kivi-k2v2-g32-r128"}
    assert verdicts == [{"rule": "fidelity-kivi2", "passed": True}]
    assert "| gsm8k" in (tmp_path / "reports" / "ci-job" / "report.md").read_text()
