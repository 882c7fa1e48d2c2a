"""The real `lm-eval` command line on SmolLM2 over offline GSM8K: `--model kivi` at 16 bits generates what
`--model hf` generates, and the pipeline's GSM8K workload builds lm-eval's prompts and scores its generations alike."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.workloads import get_workload
from pipeline.workloads.gsm8k import cut_at_stop, extract_answer

pytestmark = pytest.mark.slow

LM_EVAL = str(Path(sys.executable).with_name("lm-eval"))
TASKS = Path(__file__).resolve().parents[2] / "configs" / "lm_eval"
DOCS = 5
RUNS = {  # name: (lm-eval model, extra model args)
    "hf": ("hf", ""),
    "kivi-16": ("kivi", ",k_bits=16,v_bits=16"),
}


def lm_eval(out: Path, model: str, model_args: str, data_dir: Path) -> tuple[dict, list[dict]]:
    """Runs `lm-eval run` on the first DOCS test documents; returns its results and logged samples."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "datasets")}
    done = subprocess.run(
        [LM_EVAL, "run", "--model", model, "--model_args", model_args, "--device", "cpu",
         "--tasks", "gsm8k_local", "--include_path", str(TASKS), "--metadata", json.dumps({"data_dir": str(data_dir)}),
         "--limit", str(DOCS), "--log_samples", "--output_path", str(out)],
        check=False, capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (results,) = out.glob("*/results_*.json")
    (samples,) = out.glob("*/samples_gsm8k_local_*.jsonl")
    return json.loads(results.read_text()), [json.loads(line) for line in samples.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    from pipeline.models import converted_folder

    common = f"pretrained={converted_folder('smollm2-135m')},dtype=float32"
    out = tmp_path_factory.mktemp("lm-eval")
    return {name: lm_eval(out / name, model, common + extra, data_dir) for name, (model, extra) in RUNS.items()}


def generations(samples: list[dict]) -> dict[int, str]:
    return {s["doc_id"]: s["resps"][0][0] for s in samples if s["filter"] == "strict-match"}


def test_kivi_at_16_bits_generates_what_hf_generates(runs):
    (hf_results, hf_samples), (kivi_results, kivi_samples) = runs["hf"], runs["kivi-16"]
    assert (hf_results["config"]["model"], kivi_results["config"]["model"]) == ("hf", "kivi")
    assert kivi_results["config"]["model_args"]["k_bits"] == 16
    assert hf_results["n-samples"]["gsm8k_local"] == {"original": 1319, "effective": DOCS}
    hf, kivi = generations(hf_samples), generations(kivi_samples)
    assert sorted(hf) == list(range(DOCS)) and any(hf.values())
    assert kivi == hf
    assert kivi_results["results"] == hf_results["results"]


def test_the_pipeline_builds_lm_evals_prompts_and_scores_its_generations_alike(runs, data_dir, tokenizer):
    requests = {int(r.request_id): r for r in get_workload("gsm8k", data_dir=data_dir).requests(tokenizer, 4096)}
    samples = [s for _, run_samples in runs.values() for s in run_samples]
    assert len(samples) == len(RUNS) * DOCS * 2  # one sample per document and filter
    for sample in samples:
        request = requests[sample["doc_id"]]
        assert request.prompt == sample["arguments"]["gen_args_0"]["arg_0"]
        generation, answer_filter = sample["resps"][0][0], sample["filter"]
        assert extract_answer(cut_at_stop(generation, request.stop), answer_filter) == sample["filtered_resps"][0]
        score = get_workload("gsm8k", data_dir=data_dir, answer_filter=answer_filter).score(request, generation)
        assert score.value == sample["exact_match"], (sample["doc_id"], answer_filter)
