"""The shipped nightly pair on the CPU: a reduced copy of configs/nightly.yaml (its workloads and caches, tiny
samples, SmolLM2) runs and is gated by configs/gates/nightly.yaml with no rule failing closed, and two runs of
the same code give the same verdicts."""

from pathlib import Path

import pytest
import yaml

from pipeline.config import load_config
from pipeline.gate import evaluate, load_gate
from pipeline.runner import run
from pipeline.store import Store

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REDUCED = {
    "gsm8k": {"n": 2, "num_fewshot": 1, "max_new_tokens": 16},
    "longbench": {"subset": "mini", "tasks": ["trec"], "n": 1},
    "niah": {"lengths": [512], "depths": [0.5]},
    "fidelity": {"n": 2, "tokens": 192},
    "sharegpt": {"n": 2},
}


def test_a_reduced_nightly_run_gates_with_every_rule_and_twice_the_same_verdicts(write_config, data_dir):
    nightly = yaml.safe_load((CONFIGS / "nightly.yaml").read_text())
    assert REDUCED.keys() == nightly["workloads"].keys()  # the same workloads, smaller samples
    path = write_config(**{**nightly, "model": {"spec": "smollm2-135m", "max_context": 1024}, "workloads": REDUCED,
                           "data_dir": str(data_dir), "gate": str(CONFIGS / "gates" / "nightly.yaml"),
                           "generation": {"batch_size": 2}, "ray": {"shard_size": 4},
                           "sweep": {"start": 1, "max_batch": 2, "max_new_tokens": 4, "repeats": 2}})
    config = load_config(path)
    verdicts = {}
    for run_id in ("first", "second"):
        run(config, path.read_text(), run_id, progress=False, in_process=True)
        with Store(config.archive) as store:
            verdicts[run_id] = evaluate(store, run_id, load_gate(config.gate))

    first = verdicts["first"]
    print("\n".join(f"{v.rule} {v.cache}: {v.passed} {v.detail}" for v in first))  # for the CI log
    assert {v.rule for v in first} == {r.name for r in load_gate(config.gate).rules}
    assert not [v for v in first if v.detail.startswith(("missing", "incomplete"))]
    assert any(v.ci_low is not None for v in first)  # the accuracy rules judged intervals

    # Greedy outputs repeat exactly, and so do their statistics; sweep timings do not (two 2-token CPU runs).
    def accuracy(vs):
        return [(v.rule, v.cache, v.passed, v.observed, v.ci_low, v.ci_high, v.p_value) for v in vs
                if v.kind != "min_throughput_ratio"]

    assert accuracy(verdicts["second"]) == accuracy(first)
