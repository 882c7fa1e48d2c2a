"""NIAH and passkey: needle placement on the token grid, context lengths, deterministic scores."""

import json

import pytest

from pipeline.workloads import WorkloadOptionError, get_workload, prompt_tokens
from pipeline.workloads.niah import NEEDLE, keyword_recall, passkey_match

LENGTHS = (1024, 3000, 100_000)
DEPTHS = (0.0, 0.1, 0.5, 0.9, 1.0)
MAX_CONTEXT = 4096


@pytest.fixture(scope="module")
def cells(data_dir, tokenizer):
    workload = get_workload("niah", data_dir=data_dir, lengths=LENGTHS, depths=DEPTHS, seed=7)
    return workload, workload.requests(tokenizer, MAX_CONTEXT)


def test_the_grid_has_one_cell_per_length_and_depth_with_lengths_capped_at_the_context(cells):
    _, requests = cells
    for task in ("niah", "passkey"):
        grid = {(r.meta["context_length"], r.meta["depth"]) for r in requests if r.task == task}
        assert grid == {(length, depth) for length in (1024, 3000, MAX_CONTEXT) for depth in DEPTHS}
    assert len({(r.task, r.request_id) for r in requests}) == len(requests) == 30


def test_each_prompt_fills_its_context_length_with_room_for_the_answer(cells, tokenizer):
    _, requests = cells
    for request in requests:  # counted as the engine feeds it: inside the chat template where the request asks
        used = prompt_tokens(tokenizer, [request.prompt], [request.chat])[0] + request.max_new_tokens
        assert request.meta["context_length"] - 8 <= used <= request.meta["context_length"], request.request_id


@pytest.mark.parametrize("depth", DEPTHS)
def test_the_needle_sits_at_its_depth_of_the_haystack_moved_back_to_a_sentence_start(cells, tokenizer, depth):
    _, requests = cells
    request = next(r for r in requests if r.task == "niah" and r.request_id == f"L3000-d{depth:g}")
    haystack = request.prompt.split("\n\n", 1)[1].rsplit("\n\nWhat is the best thing", 1)[0]
    before, after = haystack.split(NEEDLE)
    if depth == 1.0:  # upstream appends the needle after the last token, mid-sentence or not
        assert after == ""
    else:
        assert before == "" or before.endswith(".")
    tokens_before = len(tokenizer(before, add_special_tokens=False).input_ids)
    tokens_total = tokens_before + len(tokenizer(after, add_special_tokens=False).input_ids)
    # At or before the depth's token, by less than one sentence (the longest in the essays has 128 tokens).
    assert 0 <= depth * tokens_total - tokens_before < 130
    if 0 < depth < 1:
        assert tokens_before > 0 and after


def test_passkeys_are_five_digits_hidden_once_and_reproducible_from_the_seed(cells, data_dir, tokenizer):
    _, requests = cells
    passkeys = [r for r in requests if r.task == "passkey"]
    for request in passkeys:
        key = json.loads(request.reference)
        assert len(key) == 5 and request.prompt.count(key) == 2  # "The pass key is K. … K is the pass key."
    again = get_workload("niah", data_dir=data_dir, lengths=(1024,), depths=(0.5,), tasks=["passkey"], seed=7)
    first = next(r for r in passkeys if r.request_id == "L1024-d0.5")
    assert again.requests(tokenizer, MAX_CONTEXT)[0].reference == first.reference


def test_the_needle_answer_scores_the_share_of_its_key_phrases():
    assert keyword_recall("Eat a sandwich and sit in Dolores Park.") == 1.0
    assert keyword_recall("A SANDWICH, surely") == 0.5
    assert keyword_recall("Visit the Golden Gate Bridge") == 0.0


def test_the_passkey_answer_must_be_exactly_the_keys_number():
    assert passkey_match(" 27611. The pass key is 27611.", "27611")
    assert not passkey_match("276111", "27611")
    assert not passkey_match("The key is 12345, or 27611", "27611")
    assert not passkey_match("I do not know", "27611")


def test_scores_use_the_metric_of_each_variant(cells):
    workload, requests = cells
    niah = next(r for r in requests if r.task == "niah")
    passkey = next(r for r in requests if r.task == "passkey")
    assert workload.score(niah, "eat a sandwich") == workload.score(niah, "a sandwich")
    assert workload.score(niah, "sandwich in Dolores Park").metric == "needle_keyword_recall"
    assert workload.score(passkey, json.loads(passkey.reference)).value == 1.0
    assert workload.score(passkey, "0").metric == "passkey_exact_match"


def test_depths_in_percent_and_a_haystack_without_data_dir_are_rejected():
    with pytest.raises(WorkloadOptionError, match=r"option 'depths'.*fractions in \[0, 1\]"):
        get_workload("niah", depths=(0, 50, 100), tasks=["passkey"])
    with pytest.raises(WorkloadOptionError, match="not on the Hugging Face Hub: set data_dir"):
        get_workload("niah")
    assert get_workload("niah", tasks=["passkey"]).options.data_dir is None  # filler needs no data


def test_a_context_length_too_short_for_the_prompt_is_an_error(tokenizer):
    workload = get_workload("niah", tasks=["passkey"], lengths=(60,), max_new_tokens=32)
    with pytest.raises(ValueError, match="passkey: context length 60 is too short"):
        workload.requests(tokenizer, MAX_CONTEXT)
