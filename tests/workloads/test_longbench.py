"""LongBench requests: official templates and lengths, middle truncation, malformed records, data errors."""

import json
import re

import pytest

from pipeline.workloads import DataSourceError, WorkloadOptionError, get_workload
from pipeline.workloads.longbench import TASKS, middle_truncate

MAX_CONTEXT = 2048


@pytest.fixture(scope="module")
def mini(data_dir, tokenizer):
    workload = get_workload("longbench", data_dir=data_dir, subset="mini", n=2)
    return workload, workload.requests(tokenizer, MAX_CONTEXT)


def test_every_english_and_code_task_gets_requests_with_its_official_generation_length(mini, data_dir):
    workload, requests = mini
    max_lengths = json.loads((data_dir / "longbench/config/dataset2maxlen.json").read_text())
    assert sorted({r.task for r in requests}) == sorted(TASKS) and len(TASKS) == 16
    assert all(r.max_new_tokens == max_lengths[r.task] for r in requests)
    assert len(requests) == 32 and not workload.skipped


def test_long_prompts_are_cut_in_the_middle_to_fit_the_context(mini, tokenizer):
    _, requests = mini
    for request in requests:
        assert len(tokenizer(request.prompt).input_ids) + request.max_new_tokens <= MAX_CONTEXT
    qasper = next(r for r in requests if r.task == "qasper")
    # The instruction at the start and the question at the end both survive the cut.
    assert qasper.prompt.startswith("You are given a scientific article and a question.")
    assert qasper.prompt.endswith("\n\nAnswer:")


def test_middle_truncation_keeps_the_first_and_last_halves_of_the_tokens(tokenizer):
    prompt = " ".join(f"w{i}" for i in range(400))
    kept = middle_truncate(tokenizer, prompt, 100)
    ids = tokenizer(prompt).input_ids
    assert kept == tokenizer.decode(ids[:50]) + tokenizer.decode(ids[-50:])
    assert middle_truncate(tokenizer, "short", 100) == "short"


def test_a_request_scores_with_its_tasks_metric(mini):
    workload, requests = mini
    trec = next(r for r in requests if r.task == "trec")
    answer = json.loads(trec.reference)[0]
    assert workload.score(trec, f"{answer}\nQuestion: more").value == 1.0
    assert workload.score(trec, "x").metric == "classification_score"
    assert trec.chat is False
    assert next(r for r in requests if r.task == "qasper").chat is True


def test_malformed_records_are_skipped_and_counted_per_task_and_reason(data_dir, tokenizer, tmp_path):
    good = {"input": "Who?", "context": "Ann met Bob.", "answers": ["Ann"], "all_classes": None}
    lines = [
        json.dumps(good),
        '{"input": "Who?", "context": "broken',
        json.dumps({k: v for k, v in good.items() if k != "answers"}),
        json.dumps(good | {"answers": "Ann"}),
        json.dumps(good | {"answers": [1]}),
        "",
        "[1, 2]",
        json.dumps(good | {"_id": "last"}),
    ]
    folder = tmp_path / "longbench" / "data"
    folder.mkdir(parents=True)
    (folder / "qasper.jsonl").write_text("\n".join(lines) + "\n")
    workload = get_workload("longbench", data_dir=tmp_path, tasks=["qasper"],
                            config_dir=data_dir / "longbench" / "config")
    requests = workload.requests(tokenizer, MAX_CONTEXT)
    assert [r.request_id for r in requests] == ["0", "last"]
    assert workload.skipped == {
        "qasper: invalid JSON": 1,
        "qasper: missing field 'answers'": 1,
        "qasper: field 'answers' is str": 1,
        "qasper: field 'answers' is not a list of strings": 1,
        "qasper: not a JSON object": 1,
    }


def test_a_missing_data_folder_is_named_in_the_error(tmp_path):
    workload = get_workload("longbench", data_dir=tmp_path / "nowhere")
    with pytest.raises(DataSourceError, match=re.escape(f"data folder {tmp_path / 'nowhere'} does not exist")):
        workload.check_data()


def test_a_missing_task_file_is_named_in_the_error(data_dir):
    # The offline copy holds the full official file of multi_news only.
    workload = get_workload("longbench", data_dir=data_dir, tasks=["multi_news", "qasper"])
    with pytest.raises(DataSourceError, match=r"longbench/data/qasper\.jsonl does not exist"):
        workload.check_data()


def test_unknown_tasks_and_hub_only_combinations_are_rejected_with_the_option_named(data_dir):
    with pytest.raises(WorkloadOptionError, match=r"option 'tasks'.*unknown LongBench tasks \['qaspr'\]"):
        get_workload("longbench", data_dir=data_dir, tasks=["qaspr"])
    with pytest.raises(WorkloadOptionError, match="subset 'mini'.*set data_dir"):
        get_workload("longbench", subset="mini", config_dir=data_dir)
    with pytest.raises(WorkloadOptionError, match="set config_dir or data_dir"):
        get_workload("longbench")
