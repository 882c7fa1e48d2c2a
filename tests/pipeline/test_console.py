"""What a run says on the console, and when: a resume and skipped records at the start, a line per sweep point,
a line per finished job counted against the plan, no third-party warnings the project causes, and no archive
write before the model spec resolves."""

import datetime as dt
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from pipeline import runner
from pipeline.archive import ArchiveWriter
from pipeline.config import RunConfig, load_config
from pipeline.models import ModelSpecError
from pipeline.names import FP16
from pipeline.worker import EvalWorker, RunContext, Shard

MODEL = {"spec": "smollm2-135m", "max_context": 1024}
K2 = "kivi-k2v2-g32-r128"


def gsm8k_with_two_bad_records(data_dir, tmp_path):
    folder = tmp_path / "data" / "gsm8k"
    folder.mkdir(parents=True)
    lines = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()
    (folder / "test.jsonl").write_text("\n".join(lines[:3] + ['{"question": "no answer"}', "{broken json"]) + "\n")
    (folder / "train.jsonl").write_text((data_dir / "gsm8k" / "train.jsonl").read_text())
    return folder.parent


def test_a_resumed_run_says_at_the_start_what_it_reuses_and_counts_skipped_records(
        write_config, data_dir, tmp_path, monkeypatch, capsys):
    path = write_config(model=MODEL, caches=["kivi-2"], data_dir=str(gsm8k_with_two_bad_records(data_dir, tmp_path)),
                        workloads={"gsm8k": {"num_fewshot": 1}}, ray={"shard_size": 1})
    config = load_config(path)
    done = ArchiveWriter(config.archive, "r1")
    row = {"model": "m", "workload_version": 3, "task": "gsm8k", "request_id": "x"}
    for shard, cache in ((0, FP16), (0, K2), (1, FP16)):  # what an interrupted run left
        done.write_results("gsm8k", cache, shard, [row])
    monkeypatch.setattr(runner, "_execute", lambda *args: None)  # planning only: no model loads

    runner.run(config, path.read_text(), run_id="r1", progress=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gsm8k: 3 requests, 2 data records skipped (") and "invalid JSON" in out[0]
    assert out[1] == ("resuming run r1: 3 shard × cache files and 0 sweeps reused from the archive, "
                      "3 shard × cache files and 0 sweeps to compute")


def test_a_model_that_cannot_load_leaves_nothing_in_the_archive(write_config, data_dir, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # a Hub id that passes validation but does not load
    path = write_config(model={"spec": "nobody/no-such-model"}, data_dir=str(data_dir), workloads={"gsm8k": {"n": 1}})
    config = load_config(path)
    with pytest.raises(ModelSpecError, match="cannot load 'nobody/no-such-model'"):
        runner.run(config, path.read_text(), progress=False)
    assert not Path(config.archive).exists()  # no `failed` run row for a run that never started


class _Engine:
    """Throughput points without a model: 10 tokens/s per sequence, out of memory from batch 4."""

    def throughput(self, requests, kivi, batch_size, max_new_tokens):
        if batch_size >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return dict(batch_size=batch_size, tokens_per_s=10.0 * batch_size, oom=False)


def test_each_sweep_point_prints_a_line_with_its_batch_and_tokens_per_s_or_oom(tmp_path, capsys):
    config = RunConfig(model={"spec": "smollm2-135m"}, workloads={"sharegpt": {}}, archive=tmp_path)
    worker = EvalWorker.__new__(EvalWorker)  # the sweep loop alone: the engine is a stub
    worker.ctx = RunContext("r1", config, dt.datetime.now(dt.UTC), None)
    worker.caches, worker.device_name = {FP16: None}, "cpu"
    worker.engine, worker.archive = _Engine(), ArchiveWriter(tmp_path, "r1")
    worker.run_sweep("sharegpt", [None] * 8, FP16)
    assert capsys.readouterr().out.splitlines() == [
        "sharegpt sweep fp16 batch 1: 10.0 tokens/s", "sharegpt sweep fp16 batch 2: 20.0 tokens/s",
        "sharegpt sweep fp16 batch 4: OOM"]


class _Started(Exception):
    pass


def test_starting_ray_prints_no_warning_that_token_auth_is_on(monkeypatch):
    import ray
    from ray._private.authentication import authentication_token_setup as auth

    records = []
    handler = logging.Handler()
    handler.emit = records.append

    def init(**kwargs):
        auth._warn_token_auth_enabled()  # what ray.init says on every start of a local cluster
        raise _Started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    config = RunConfig(model={"spec": "smollm2-135m"}, workloads={"gsm8k": {}})
    level = auth.logger.level
    auth.logger.addHandler(handler)
    try:
        with pytest.raises(_Started):
            next(runner.run_jobs(runner.EvalWorker, None, config.ray, [], [], in_process=False))
    finally:
        auth.logger.removeHandler(handler)
        auth.logger.setLevel(level)
    assert records == []


def test_decoding_with_the_packaged_tokenizer_prints_no_transformers_warning():
    code = ("from pipeline.models import load_tokenizer\n"
            "t = load_tokenizer('smollm2-135m')\n"
            "print(t.decode(t('Hello , world !').input_ids, skip_special_tokens=True))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "Hello , world !"  # no clean-up either way: BPE keeps the spaces
    assert "clean_up_tokenization_spaces" not in done.stderr


def test_each_finished_job_prints_one_line_counted_against_the_plan(tmp_path, monkeypatch, capsys):
    config = RunConfig(model={"spec": "smollm2-135m"}, workloads={"gsm8k": {}}, archive=tmp_path)
    one, two = (Shard("gsm8k", i, (None,) * (i + 1)) for i in range(2))
    timed = {"fp16": {"rows": 1, "seconds": 2.04}, K2: {"rows": 1, "seconds": 3.0}}
    points = [dict(batch_size=1, tokens_per_s=10.0, oom=False), dict(batch_size=2, tokens_per_s=18.5, oom=False),
              dict(batch_size=4, oom=True)]
    finished = [(0, ("run_sweep", ("sharegpt", [], K2)), points), (0, ("run_shard", (one, ["fp16", K2])), timed),
                (0, ("run_shard", (two, ["fp16"])), {"fp16": timed["fp16"]})]

    def in_process(worker_cls, ctx, jobs, placements):
        placements[:] = [{"jobs": 0}]
        yield from finished

    monkeypatch.setattr(runner, "_in_process", in_process)
    summary = runner.RunSummary("r1")
    runner._execute(config, None, [(one, ["fp16", K2]), (two, ["fp16"])], [("sharegpt", [], K2)], summary, True, True)
    lines = [re.sub(r"; [\d.]+ s\]", "; T]", line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        f"[0/3 shard × cache files, 1/1 sweeps; T] sharegpt sweep {K2}: best 18.5 tokens/s at batch 2 (3 timings)",
        f"[2/3 shard × cache files, 1/1 sweeps; T] gsm8k shard 0 (1 request): fp16 2.0 s, {K2} 3.0 s",
        "[3/3 shard × cache files, 1/1 sweeps; T] gsm8k shard 1 (2 requests): fp16 2.0 s"]
    assert summary.placements == [{"jobs": 3}] and len(summary.computed) == 3


@pytest.mark.parametrize("seconds, shown", [(48.24, "48.2 s"), (677, "11 min 17 s"), (7500, "2 h 5 min")])
def test_durations_read_at_a_glance(seconds, shown):
    assert runner.format_seconds(seconds) == shown


def test_an_actor_loads_its_model_without_a_progress_bar(tiny_model_folder, tmp_path):
    # Ray forwards an actor's output line by line: a bar would print one line per update.
    code = ("import datetime as dt\nfrom pipeline.config import RunConfig\nfrom pipeline.worker import EvalWorker, RunContext\n"
            f"config = RunConfig(model={{'spec': {str(tiny_model_folder(64))!r}}}, workloads={{'gsm8k': {{}}}}, "
            f"archive={str(tmp_path)!r})\n"
            "EvalWorker(RunContext('r1', config, dt.datetime.now(dt.UTC), None))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr and "it/s]" not in done.stderr
