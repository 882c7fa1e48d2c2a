"""A run that stops on a model its cache cannot hold still closes its manifest, gates and reports what it wrote;
the fidelity CLI refuses such a model before its first forward pass."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from kivi import KiviConfigError
from kivi.fidelity import measure_fidelity
from pipeline.cli import RUN_FAILED, main
from pipeline.store import Store


@pytest.fixture(scope="module")
def head_dim_48_model(tiny_model_folder):
    """A random Llama with head_dim 48, which KIVI's per-token value groups of 32 cannot split."""
    return tiny_model_folder(48)


def test_a_run_stopped_by_its_cache_is_marked_failed_gated_and_reported_as_partial(head_dim_48_model, data_dir,
                                                                                   tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"rules": [{"name": "gsm8k-drop", "kind": "max_drop", "workload": "gsm8k", "margin": 5}]}))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(dict(
        kind="smoke", model={"spec": str(head_dim_48_model), "max_context": 1024}, caches=["kivi-2"],
        workloads={"gsm8k": {"n": 2, "num_fewshot": 1, "max_new_tokens": 4}}, data_dir=str(data_dir),
        archive=str(tmp_path / "archive"), reports=str(tmp_path / "reports"), gate=str(rules),
        generation={"batch_size": 2}, ray={"shard_size": 2})))

    assert main(["run", str(config), "--no-ray"]) == RUN_FAILED
    assert "failed after" in capsys.readouterr().err

    with Store(tmp_path / "archive") as store:
        (run,) = store.records("SELECT * FROM runs")
        results = store.records("SELECT cache, count(*) AS n FROM results GROUP BY cache")
        verdicts = store.records("SELECT * FROM verdicts")
    assert run["status"] == "failed" and run["finished_at"] is not None
    assert run["error"].startswith("KiviConfigError:") and "head_dim=48" in run["error"]
    assert json.loads(run["skipped"]) == {"gsm8k": {}}
    assert results == [{"cache": "fp16", "n": 2}]  # the fp16 shard finished before KIVI-2 was refused
    assert [(v["rule"], v["passed"]) for v in verdicts] == [("gsm8k-drop", False)]
    report = (tmp_path / "reports" / run["run_id"] / "report.md").read_text()
    assert f"**Partial results: the run failed: {run['error']}." in report


def test_the_fidelity_measure_refuses_a_cache_the_model_cannot_hold_before_any_forward_pass(head_dim_48_model):
    model = AutoModelForCausalLM.from_pretrained(head_dim_48_model)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(KiviConfigError, match="head_dim=48"):
        measure_fidelity(model, torch.randint(0, 100, (1, 96)), ("fp16", "kivi-2"))
    assert forwards == []
