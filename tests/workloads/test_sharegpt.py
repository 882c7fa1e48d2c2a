"""ShareGPT throughput requests: vLLM's sampling, length filters and their counts."""

import json
import re

import pytest

from pipeline.workloads import DataSourceError, get_workload
from pipeline.workloads.sharegpt import ShareGPTOptions, length_filter

WORDS = " ".join(["word"] * 40)  # 40 tokens for SmolLM2's tokenizer


def conversation(prompt: str, reply: str, first: str = "human") -> dict:
    return {"id": prompt[:8], "conversations": [{"from": first, "value": prompt}, {"from": "gpt", "value": reply}]}


def test_the_length_filter_applies_vllms_thresholds_in_order():
    options = ShareGPTOptions()
    assert length_filter(3, 100, options, 4096) == "prompt < 4 tokens"
    assert length_filter(100, 3, options, 4096) == "output < 4 tokens"
    assert length_filter(1025, 100, options, 4096) == "prompt > 1024 tokens"
    assert length_filter(1000, 1049, options, 4096) == "prompt + output > 2048 tokens"
    assert length_filter(1000, 1048, options, 4096) is None
    assert length_filter(1000, 1000, options, 1999) == "prompt + output > max_context"


def test_requests_keep_the_first_turn_as_prompt_and_the_replys_length_as_output(tmp_path, tokenizer):
    entries = [
        conversation("Hi", WORDS),  # prompt too short
        conversation(WORDS, "Ok"),  # output too short
        conversation(WORDS + " " + WORDS, WORDS),  # prompt above max_prompt_len
        conversation(WORDS, WORDS + " " + WORDS),  # total above max_total_len
        {"id": "lone", "conversations": [{"from": "human", "value": WORDS}]},
        {"id": "empty"},
        {"id": "bad", "conversations": [{"from": "human"}, {"from": "gpt", "value": WORDS}]},
        conversation("Tell me about the weather in Lisbon today.", WORDS),
    ]
    (tmp_path / "sharegpt").mkdir()
    (tmp_path / "sharegpt" / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(entries))
    workload = get_workload("sharegpt", data_dir=tmp_path, n=10, max_prompt_len=60, max_total_len=100)
    [request] = workload.requests(tokenizer, max_context=4096)
    assert (request.request_id, request.prompt) == ("7", "Tell me about the weather in Lisbon today.")
    assert request.max_new_tokens == len(tokenizer(WORDS).input_ids) == 40
    assert request.prompt_tokens == len(tokenizer(request.prompt).input_ids)
    assert workload.skipped == {
        "filtered: prompt < 4 tokens": 1,
        "filtered: output < 4 tokens": 1,
        "filtered: prompt > 60 tokens": 1,
        "filtered: prompt + output > 100 tokens": 1,
        "filtered: fewer than two turns": 2,
        "malformed: turn without a text 'value'": 1,
    }


def test_sampling_is_reproducible_per_seed_and_every_request_passes_the_filters(data_dir, tokenizer):
    def sample(seed):
        return get_workload("sharegpt", data_dir=data_dir, n=30, seed=seed).requests(tokenizer, max_context=2048)

    first, again, other = sample(0), sample(0), sample(1)
    assert [r.request_id for r in first] == [r.request_id for r in again]
    assert [r.request_id for r in first] != [r.request_id for r in other]
    assert len(first) == 30
    for request in first:
        prompt_len = len(tokenizer(request.prompt).input_ids)
        assert 4 <= prompt_len <= 1024 and request.max_new_tokens >= 4
        assert prompt_len + request.max_new_tokens <= 2048


def test_a_folder_with_no_sharegpt_file_is_named_in_the_error(tmp_path):
    (tmp_path / "sharegpt").mkdir()
    with pytest.raises(DataSourceError, match=re.escape(f"{tmp_path / 'sharegpt'}: expected one file matching")):
        get_workload("sharegpt", data_dir=tmp_path).check_data()
