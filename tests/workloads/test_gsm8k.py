"""GSM8K: lm-eval's prompt, answer filters and exact match, checked by hand and against lm-eval itself."""

import json
from pathlib import Path

import pytest

from pipeline.workloads import Request, get_workload
from pipeline.workloads.gsm8k import exact_match, extract_answer

OFFLINE_TASK = Path(__file__).resolve().parents[2] / "configs" / "lm_eval" / "gsm8k_local.yaml"
REFERENCE_1000 = "He pays 10 * 100 = $<<10*100=1000>>1000.\n#### 1000"
GENERATIONS = ["Steps.\n#### 1,000.", "It costs $1,000.", "#### 1000\n\nQuestion: #### 5", "#### 1000 #### 5", "", "1000 or 7"]


def lm_eval_gsm8k_config() -> dict:
    task_module = pytest.importorskip("lm_eval.api.task")
    import yaml

    return yaml.safe_load((Path(task_module.__file__).parents[1] / "tasks/gsm8k/gsm8k.yaml").read_text())


@pytest.fixture(scope="module")
def gsm8k(data_dir):
    return get_workload("gsm8k", data_dir=data_dir, n=20, seed=3)


@pytest.fixture(scope="module")
def requests(gsm8k, tokenizer):
    return gsm8k.requests(tokenizer, max_context=2048)


def test_strict_match_takes_the_number_after_the_hash_marks():
    assert extract_answer("So he pays 5.\n#### 1,000.") == "1,000."
    assert extract_answer("#### -3 apples") == "-3"
    assert extract_answer("#### 1000 or maybe #### 5") == "1000"  # the first, unlike flexible-extract
    assert extract_answer("The answer is 1000.") == "[invalid]"


def test_flexible_extract_takes_the_last_number_in_the_text():
    assert extract_answer("5 apples and 7 pears make 12.", "flexible-extract") == "12."
    assert extract_answer("It costs $1,000.", "flexible-extract") == "$1,000."
    assert extract_answer("no digits", "flexible-extract") == "[invalid]"


def test_exact_match_ignores_commas_dollars_and_a_final_period():
    assert exact_match("$1,000.", REFERENCE_1000)
    assert exact_match("1000", REFERENCE_1000)
    assert not exact_match("1000.0", REFERENCE_1000)
    assert not exact_match("[invalid]", REFERENCE_1000)


def test_the_prompt_holds_five_solved_train_questions_then_the_test_question(requests):
    request = requests[0]
    assert request.prompt.count("Question: ") == 6
    assert request.prompt.count("\n#### ") == 5
    assert request.prompt.endswith("\nAnswer:")
    assert request.stop == ("Question:", "</s>", "<|im_end|>")
    assert (request.workload, request.task, request.max_new_tokens) == ("gsm8k", "gsm8k", 256)


def test_sampling_is_reproducible_and_a_sample_keeps_each_questions_prompt(gsm8k, requests, tokenizer, data_dir):
    assert [r.request_id for r in requests] == [r.request_id for r in gsm8k.requests(tokenizer, 2048)]
    larger = get_workload("gsm8k", data_dir=data_dir, n=400, seed=4).requests(tokenizer, 2048)
    prompts = {r.request_id: r.prompt for r in larger}
    shared = [r for r in requests if r.request_id in prompts]
    assert shared, "samples of 20 and 400 out of 1,319 overlap for these seeds"
    assert all(prompts[r.request_id] == r.prompt for r in shared)


def test_a_generation_is_cut_at_the_stop_string_before_its_answer_is_read(gsm8k, requests):
    request = requests[0]
    answer = json.loads(request.reference).split("#### ")[-1]
    assert gsm8k.score(request, f"Some steps.\n#### {answer}\n\nQuestion: next\n#### 0").value == 1.0
    assert gsm8k.score(request, f"Some steps.\n\nQuestion: next\n#### {answer}").value == 0.0
    assert gsm8k.score(request, "x").metric == "exact_match,strict-match"


def test_prompts_that_do_not_fit_the_context_are_skipped_and_counted(data_dir, tokenizer):
    workload = get_workload("gsm8k", data_dir=data_dir, n=5)
    assert workload.requests(tokenizer, max_context=300) == []
    assert workload.skipped == {"test: prompt longer than max_context - max_new_tokens": 5}


def test_the_offline_lm_eval_task_is_lm_evals_gsm8k_but_for_its_name_and_data():
    theirs = lm_eval_gsm8k_config()
    from lm_eval.tasks._yaml_loader import load_yaml

    ours = load_yaml(OFFLINE_TASK, resolve_func=False)  # leaves `!function` unresolved
    assert ours.pop("task") == "gsm8k_local" and ours.pop("custom_dataset").endswith("local_data.gsm8k")
    for field in ("task", "tag", "dataset_path", "dataset_name"):
        del theirs[field]
    assert ours == theirs


def test_prompts_equal_lm_evals_gsm8k_prompts(data_dir, tokenizer, tmp_path):
    config = lm_eval_gsm8k_config()
    from lm_eval.api.task import ConfigurableTask

    del config["tag"], config["dataset_name"]
    files = {split: str(data_dir / "gsm8k" / f"{split}.jsonl") for split in ("train", "test")}
    config |= {"dataset_path": "json", "dataset_kwargs": {"data_files": files, "cache_dir": str(tmp_path)}}
    task = ConfigurableTask(config=config)
    task.set_fewshot_seed(1234)  # lm-eval's default fewshot_random_seed
    expected = [task.fewshot_context(doc, 5) for doc in list(task.test_docs())[:30]]
    ours = get_workload("gsm8k", data_dir=data_dir).requests(tokenizer, max_context=4096)
    assert [r.prompt for r in ours[:30]] == expected


@pytest.mark.parametrize("answer_filter", ["strict-match", "flexible-extract"])
def test_scores_equal_lm_evals_filter_and_exact_match(answer_filter):
    config = lm_eval_gsm8k_config()
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    regex = next(f["filter"][0] for f in config["filter_list"] if f["name"] == answer_filter)
    options = ("ignore_case", "ignore_punctuation", "regexes_to_ignore")
    metric = {key: config["metric_list"][0][key] for key in options}
    stops = config["generation_kwargs"]["until"]
    workload = get_workload("gsm8k", data_dir="unused", answer_filter=answer_filter)
    request = Request("0", "gsm8k", "gsm8k", "", 256, json.dumps(REFERENCE_1000), stop=tuple(stops))
    for generation in GENERATIONS:
        cut = generation
        for stop in stops:  # lm-eval's HF model cuts the generation at each stop string
            cut = cut.split(stop)[0]
        kept = RegexFilter(regex["regex_pattern"], regex.get("group_select", 0)).apply([[cut]], None)[0][0]
        expected = exact_match_hf_evaluate([kept], [REFERENCE_1000], **metric)["exact_match"]
        assert workload.score(request, generation).value == expected, generation
