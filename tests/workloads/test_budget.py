"""Token budgets as the model sees them: the chat template counted, no request past max_context, NIAH cells
labelled with the length they have."""

import pytest

from pipeline.runner import workload_requests
from pipeline.workloads import BudgetError, Request, chat_template_tokens, check_budget, get_workload


def engine_tokens(tokenizer, request: Request) -> int:
    """Counted by hand, as the engine feeds a request: the chat template's text where asked, no special tokens added."""
    text = request.prompt
    if request.chat:
        messages = [{"role": "user", "content": request.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_the_chat_template_counts_every_token_it_wraps_around_a_prompt(tokenizer):
    empty = Request("r", "w", "t", "", 0, "null", chat=True)
    # SmolLM2's template: a system turn, the user turn and the assistant header (~30 tokens, not 2 keys).
    assert chat_template_tokens(tokenizer) == engine_tokens(tokenizer, empty) > 20


@pytest.mark.parametrize("max_context", [1024, 1536])
def test_niah_cells_hold_their_labelled_length_with_the_chat_template_and_the_answer(data_dir, tokenizer, max_context):
    workload = get_workload("niah", data_dir=data_dir, lengths=(512, 1024, 4096), depths=(0.0, 0.5, 1.0))
    requests = workload_requests(workload, tokenizer, max_context)
    assert {r.meta["context_length"] for r in requests} == {512, 1024, max_context}
    for request in requests:
        used = engine_tokens(tokenizer, request) + request.max_new_tokens
        assert request.meta["context_length"] - 8 <= used <= request.meta["context_length"], (request.task, request.request_id)


def test_longbench_prompts_fit_the_context_inside_the_chat_template(data_dir, tokenizer):
    workload = get_workload("longbench", data_dir=data_dir, subset="mini", n=2, tasks=["qasper", "samsum", "trec"])
    requests = workload_requests(workload, tokenizer, 1024)
    assert any(r.chat for r in requests) and any(not r.chat for r in requests)
    for request in requests:
        assert engine_tokens(tokenizer, request) + request.max_new_tokens <= 1024, (request.task, request.request_id)


def test_a_request_past_max_context_is_refused_naming_it(tokenizer):
    fits = Request("short", "w", "t", "Hello there.", 8, "null")
    long = Request("long", "w", "t", "word " * 200, 8, "null", chat=True)
    check_budget([fits], tokenizer, 64)
    with pytest.raises(BudgetError, match=r"w/t/long: \d+ prompt tokens \+ 8 new exceed max_context 64"):
        check_budget([fits, long], tokenizer, 64)
