import pytest

from pipeline.workloads import WorkloadOptionError, get_workload


def test_fidelity_requests_are_consecutive_windows_of_the_haystack(tokenizer, data_dir):
    workload = get_workload("fidelity", n=3, tokens=300, data_dir=data_dir)
    requests = workload.requests(tokenizer, max_context=4096)
    assert [r.request_id for r in requests] == ["window0", "window1", "window2"]
    assert all(r.teacher_forcing.tokens == 300 and r.teacher_forcing.chunk == 32 for r in requests)
    for request in requests:  # each window re-tokenizes to (about) its token count
        assert abs(len(tokenizer(request.prompt, add_special_tokens=False).input_ids) - 300) <= 3
    assert requests[0].prompt.startswith(sorted((data_dir / "niah" / "PaulGrahamEssays").glob("*.txt"))[0].read_text()[:40])
    assert len({r.prompt for r in requests}) == 3


def test_fidelity_windows_are_capped_at_the_context(tokenizer, data_dir):
    requests = get_workload("fidelity", n=1, tokens=4096, data_dir=data_dir).requests(tokenizer, max_context=512)
    assert requests[0].teacher_forcing.tokens == 512


@pytest.mark.parametrize("options, message", [
    (dict(tokens=40, chunk=32), "use tokens >= 2 \\* chunk"),
    (dict(data_dir=None), "set data_dir"),
])
def test_fidelity_options_are_checked(data_dir, options, message):
    with pytest.raises(WorkloadOptionError, match=message):
        get_workload("fidelity", **{"data_dir": data_dir, **options})
