"""Runs on a real Ray head node with SmolLM2: an actor killed mid-run, a run interrupted and resumed."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from pipeline.archive import ArchiveWriter
from pipeline.runner import ResumeError, run
from pipeline.store import Store
from pipeline.worker import CRASH_ONCE_ENV, crash_marker

pytestmark = pytest.mark.slow

MODEL = {"spec": "smollm2-135m", "max_context": 1024}
GSM8K = {"n": 6, "num_fewshot": 1, "max_new_tokens": 24}


def _rows(archive, run_id):
    with Store(archive) as store:
        return store.records(
            "SELECT request_id, cache, prediction, score, error FROM results WHERE run_id = $1 ORDER BY ALL", [run_id])


def test_a_killed_actor_is_replaced_and_the_archive_has_one_row_per_request_and_cache(
        write_config, data_dir, tmp_path, ray_head, monkeypatch):
    # A GSM8K copy with two malformed records: skipped, counted in the manifest and the report.
    gsm8k = tmp_path / "data" / "gsm8k"
    gsm8k.mkdir(parents=True)
    lines = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()
    (gsm8k / "test.jsonl").write_text("\n".join(lines[:20] + ['{"question": "no answer"}', "{broken json"]) + "\n")
    (gsm8k / "train.jsonl").write_text((data_dir / "gsm8k" / "train.jsonl").read_text())
    path = write_config(model=MODEL, caches=["kivi-2"], data_dir=str(tmp_path / "data"), workloads={"gsm8k": GSM8K},
                        generation={"batch_size": 2}, ray={"address": ray_head[0], "num_actors": 2, "shard_size": 1})
    config = load_config(path)
    monkeypatch.setenv(CRASH_ONCE_ENV, "gsm8k:2")  # the actor running shard 2 dies the first time
    summary = run(config, path.read_text(), progress=False)

    assert (Path(config.archive) / crash_marker(summary.run_id, "gsm8k", 2)).exists(), "the fault was not injected"
    rows = _rows(config.archive, summary.run_id)
    keys = [(r["request_id"], r["cache"]) for r in rows]
    assert len(keys) == len(set(keys)) == 6 * 2
    assert all(r["error"] is None and r["prediction"] is not None for r in rows)
    # Both actors came up, each reports its process and the jobs it finished; the crashed one lost its job, which
    # ran again on the next free actor.
    assert len({p["pid"] for p in summary.placements}) == 2
    assert sum(p["jobs"] for p in summary.placements) == 6 and sum(p["lost_jobs"] for p in summary.placements) == 1
    assert all(p["ready_s"] > p["load_s"] > 0 for p in summary.placements)  # start-up includes the model load
    with Store(config.archive) as store:
        (skipped, placements), = store.query("SELECT skipped, placements FROM runs WHERE run_id = $1", [summary.run_id])[1]
    assert sum(json.loads(skipped)["gsm8k"].values()) == 2
    assert json.loads(placements) == summary.placements  # the manifest keeps where the run ran


def test_an_interrupted_run_resumes_only_the_missing_shards_and_equals_an_uninterrupted_run(
        write_config, data_dir, tmp_path, ray_head):
    path = write_config(model=MODEL, caches=["kivi-2"], data_dir=str(data_dir), workloads={"gsm8k": GSM8K},
                        generation={"batch_size": 2}, ray={"address": ray_head[0], "num_actors": 1, "shard_size": 1})
    config = load_config(path)
    total = 6 * 2  # shards × caches
    results = Path(config.archive) / "results" / "run_id=interrupted"
    driver = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(path), "--run-id", "interrupted"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while len(list(results.rglob("shard-*.parquet"))) < 3 and time.time() < deadline and driver.poll() is None:
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver dies: no cleanup, no status update
    driver.wait()
    done = len(list(results.rglob("shard-*.parquet")))
    assert 0 < done < total, f"interrupted after {done} of {total} files"

    resumed = run(config, path.read_text(), run_id="interrupted", progress=False)
    assert resumed.reused == done
    assert len(resumed.computed) == total - done  # only the missing shard × cache pairs

    fresh = run(config, path.read_text(), run_id="uninterrupted", progress=False)
    assert len(fresh.computed) == total
    assert _rows(config.archive, "interrupted") == _rows(config.archive, "uninterrupted")

    # The same worker without Ray (`kivi-eval run --no-ray`) writes the same rows.
    local = run(config, path.read_text(), run_id="in-process", progress=False, in_process=True)
    assert len(local.computed) == total and local.placements[0]["ray_gpu_ids"] == []
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # the worker's choice of a deterministic SDPA kernel
    assert _rows(config.archive, "in-process") == _rows(config.archive, "uninterrupted")


def test_the_sweep_doubles_the_batch_on_the_static_engine_and_records_each_point(write_config, data_dir):
    path = write_config(model=MODEL, caches=["kivi-2-r32"], data_dir=str(data_dir), workloads={"sharegpt": {"n": 4}},
                        sweep={"start": 1, "max_batch": 4, "max_new_tokens": 6})
    config = load_config(path)
    summary = run(config, path.read_text(), progress=False, in_process=True)
    assert sorted(summary.sweeps) == ["fp16", "kivi-k2v2-g32-r32"]
    with Store(config.archive) as store:
        points = store.records("SELECT * FROM perf ORDER BY cache, batch_size")
    assert [(p["cache"], p["batch_size"]) for p in points] == [
        (cache, b) for cache in ("fp16", "kivi-k2v2-g32-r32") for b in (1, 2, 4)]
    for p in points:
        assert not p["oom"] and p["gen_len"] == 6 and p["prompt_len"] > 0
        assert p["tokens_per_s"] > 0 and p["decode_tokens_per_s"] > 0 and p["step_ms"] > 0 and p["prefill_s"] > 0
        assert p["kv_bytes"] > 0 and p["fp16_kv_bytes"] > 0


def test_a_run_resumed_under_another_shard_layout_or_workload_is_refused_before_anything_loads(write_config, data_dir):
    started = write_config("started.yaml", model=MODEL, caches=["kivi-2"], data_dir=str(data_dir),
                           workloads={"gsm8k": GSM8K}, ray={"shard_size": 2})
    ArchiveWriter(load_config(started).archive, "r1").write_run(
        {"kind": "nightly", "model": MODEL["spec"], "config_yaml": started.read_text()})
    for name, fields in (("shards.yaml", dict(ray={"shard_size": 1})),
                         ("more.yaml", dict(workloads={"gsm8k": {**GSM8K, "n": 7}}, ray={"shard_size": 2}))):
        path = write_config(name, model=MODEL, caches=["kivi-2"], data_dir=str(data_dir),
                            **{"workloads": {"gsm8k": GSM8K}, **fields})
        config = load_config(path)
        with pytest.raises(ResumeError) as err:
            run(config, path.read_text(), run_id="r1", progress=False)
        assert re.match(r"run r1 was started with other (ray.shard_size|workloads): ", str(err.value))
        # the query that shows the run's config reads the archive the run is in
        assert f"kivi-eval query --archive {config.archive} \"SELECT config_yaml FROM runs" in str(err.value)
    generated = ArchiveWriter(load_config(started).archive, "g1")
    generated.write_run({"kind": "generate", "model": MODEL["spec"], "config_yaml": "kind: generate\n"})
    with pytest.raises(ResumeError, match=r"run g1 in .* is a generate run, and this config's kind is nightly: "
                                          r"resume it with a generate config, or start a new run id"):
        run(load_config(started), started.read_text(), run_id="g1", progress=False)
    manifest = ArchiveWriter(load_config(started).archive, "r1").read_run()
    assert manifest["status"] == "running" and manifest["config_yaml"] == started.read_text()  # left as it was
