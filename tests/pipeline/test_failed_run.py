"""A cache the model cannot hold is refused before anything is written or loaded; a run that stops mid-way still
closes its manifest, gates and reports what it wrote; the fidelity CLI refuses such a model before its first
forward pass."""

import json
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from kivi import KiviConfigError
from kivi.fidelity import measure_fidelity
from pipeline.cli import INTERRUPTED, RUN_FAILED, main
from pipeline.engine import Engine
from pipeline.store import Store

BAD_INPUT = 2


@pytest.fixture(scope="module")
def head_dim_48_model(tiny_model_folder):
    """A random Llama with head_dim 48, which KIVI's per-token value groups of 32 cannot split."""
    return tiny_model_folder(48)


def run_config(tmp_path, model, data_dir) -> str:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"rules": [{"name": "gsm8k-drop", "kind": "max_drop", "workload": "gsm8k", "margin": 5}]}))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(dict(
        kind="smoke", model={"spec": str(model), "max_context": 1024}, caches=["kivi-2"],
        workloads={"gsm8k": {"n": 2, "num_fewshot": 1, "max_new_tokens": 4}}, data_dir=str(data_dir),
        archive=str(tmp_path / "archive"), reports=str(tmp_path / "reports"), gate=str(rules),
        generation={"batch_size": 2}, ray={"shard_size": 2})))
    return str(config)


def test_a_cache_the_model_cannot_hold_is_refused_before_anything_is_written(head_dim_48_model, data_dir, tmp_path,
                                                                             capsys, monkeypatch):
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    assert main(["run", run_config(tmp_path, head_dim_48_model, data_dir), "--no-ray"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert "caches: kivi-k2v2-g32-r128 cannot hold" in err and "head_dim=48" in err
    assert loads == [] and not (tmp_path / "archive").exists()


def test_a_run_stopped_mid_way_is_marked_failed_gated_and_reported_as_partial(tiny_model_folder, data_dir, tmp_path,
                                                                               capsys, monkeypatch):
    generate = Engine.generate

    def kivi_fails(engine, requests, kivi, batch_size):
        if kivi is not None:
            raise RuntimeError("the KIVI shard's engine stopped")
        return generate(engine, requests, kivi, batch_size)

    monkeypatch.setattr(Engine, "generate", kivi_fails)
    assert main(["run", run_config(tmp_path, tiny_model_folder(64), data_dir), "--no-ray"]) == RUN_FAILED
    err = capsys.readouterr().err
    assert "failed after" in err

    with Store(tmp_path / "archive") as store:
        (run,) = store.records("SELECT * FROM runs")
        results = store.records("SELECT cache, count(*) AS n FROM results GROUP BY cache")
        verdicts = store.records("SELECT * FROM verdicts")
    assert run["status"] == "failed" and run["finished_at"] is not None
    assert run["error"] == "RuntimeError: the KIVI shard's engine stopped"
    assert f"the same command with --run-id {run['run_id']} computes only what is missing" in err
    assert json.loads(run["skipped"]) == {"gsm8k": {}}
    assert results == [{"cache": "fp16", "n": 2}]  # the fp16 shard finished before KIVI-2 stopped the run
    assert [(v["rule"], v["passed"]) for v in verdicts] == [("gsm8k-drop", False)]
    report = (tmp_path / "reports" / run["run_id"] / "report.md").read_text()
    assert f"**Partial results: the run failed: {run['error']}." in report


def test_a_run_interrupted_says_how_to_resume_and_leaves_its_manifest_failed(tiny_model_folder, data_dir, tmp_path,
                                                                            capsys, monkeypatch):
    def interrupted(engine, requests, kivi, batch_size):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    assert main(["run", run_config(tmp_path, tiny_model_folder(64), data_dir), "--no-ray"]) == INTERRUPTED
    with Store(tmp_path / "archive") as store:
        (run,) = store.records("SELECT * FROM runs")
    assert run["status"] == "failed" and run["error"] == "KeyboardInterrupt"
    err = capsys.readouterr().err
    assert f"run {run['run_id']} interrupted after" in err and f"--run-id {run['run_id']} computes only" in err
    assert "Traceback" not in err and not (tmp_path / "reports").exists()  # no gate or report after Ctrl-C


def test_the_fidelity_measure_refuses_a_cache_the_model_cannot_hold_before_any_forward_pass(head_dim_48_model):
    model = AutoModelForCausalLM.from_pretrained(head_dim_48_model)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(KiviConfigError, match="head_dim=48"):
        measure_fidelity(model, torch.randint(0, 100, (1, 96)), ("fp16", "kivi-2"))
    assert forwards == []


def dynamic_rope_copy(folder, tmp_path):
    """The tiny model's folder with dynamic NTK rotary scaling in its config: the decode engine refuses it."""
    copy = tmp_path / "dynamic"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("case, message", [
    ("context", "model.max_context: 4096 tokens is past the 2048 positions"),
    ("sweep", "workloads.sharegpt: the sweep runs on the decode engine, which cannot run fp16: "
              "LlamaForCausalLM: 'dynamic' rotary scaling"),
])
def test_what_the_model_cannot_run_is_refused_from_its_config_before_anything_loads(tiny_model_folder, data_dir,
                                                                                    tmp_path, capsys, case, message):
    config = yaml.safe_load(open(run_config(tmp_path, tiny_model_folder(64), data_dir)))
    if case == "context":
        config["model"]["max_context"] = 4096
    else:
        config["model"]["spec"] = str(dynamic_rope_copy(config["model"]["spec"], tmp_path))
        config["workloads"] = {"sharegpt": {"n": 4}}
        config.pop("gate")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["run", str(tmp_path / "run.yaml"), "--no-ray"]) == BAD_INPUT
    assert message in capsys.readouterr().err and not (tmp_path / "archive").exists()
