"""A generate run's archive, written by hand so that every count is known: the generation views, the min_exact_match
rule, the report's generation section and the OpenAI results stream, in a folder and in the S3 server alike.

Run "g" of 10 input rows in 2 shards, fp16 and kivi-2: rows 0-5 greedy and identical; row 6 parts at token 2; row
7 stops one token early under kivi-2 (it parts at token 3, where fp16 goes on); row 8 failed under kivi-2 (out
of memory); row 9 is a duplicate id, an error row under both. Two sampled rows (10, 11) do not count as greedy.
"""

import datetime as dt
import json

import pytest

from pipeline.archive import ArchiveWriter
from pipeline.gate import MinExactMatch, evaluate
from pipeline.generation import openai
from pipeline.report import write_report
from pipeline.store import Store

K2 = "kivi-k2v2-g32-r128"
STARTED = dt.datetime(2026, 1, 5, tzinfo=dt.UTC)
FP16_TOKENS = {row: [5, 6, 7, 8] for row in range(12)}
K2_TOKENS = {**FP16_TOKENS, 6: [5, 6, 9, 9], 7: [5, 6, 7], 10: [1, 2, 3, 4], 11: [5, 6, 7, 9]}


def row(cache: str, n: int, tokens: dict[int, list[int]], shard_s: float, error: str | None = None) -> dict:
    base = dict(started_at=STARTED, model="smollm2-135m", row=n, id=f"id{n}", max_new_tokens=4,
                temperature=0.8 if n >= 10 else 0.0, top_p=1.0, top_k=0, seed=n, shard_s=shard_s)
    if error:
        return base | dict(error_code=error, error=f"{error} on row {n}")
    ids = tokens[n]
    return base | dict(prompt_hash=f"{n:016x}", prompt_tokens=20, output_text=" ".join(map(str, ids)),
                       output_token_ids=ids, output_tokens=len(ids), latency_s=0.1,
                       finish_reason="length" if len(ids) == 4 else "eos", kl_to_fp16=None if cache == "fp16" else 0.01 * n,
                       error_code=None, error=None)


def write_run(root: str, run_id: str = "g", k2_rows=range(12)) -> ArchiveWriter:
    writer = ArchiveWriter(root, run_id)
    writer.write_run({"kind": "generate", "model": "smollm2-135m", "status": "complete", "started_at": STARTED})
    for cache, tokens, errors, seconds in (("fp16", FP16_TOKENS, {9: "duplicate_id"}, (2.0, 3.0)),
                                           (K2, K2_TOKENS, {8: "out_of_memory", 9: "duplicate_id"}, (4.0, 6.0))):
        for shard, rows in enumerate((range(0, 6), range(6, 12))):
            mine = [row(cache, n, tokens, seconds[shard], errors.get(n)) for n in rows if cache == "fp16" or n in k2_rows]
            writer.write_generations(cache, shard, mine)
    return writer


def test_the_generation_views_pair_each_row_with_fp16s_and_count_what_differs(root):
    write_run(root)
    with Store(root) as store:
        (agreement,) = store.records("SELECT * FROM generation_agreement")
        pairs = {p["row"]: p for p in store.records("SELECT * FROM generation_pairs")}
        summary = {s["cache"]: s for s in store.records("SELECT * FROM generation_summary")}
        (run,) = store.records("SELECT kind, generations, generation_errors, results FROM run_summary")
    assert (agreement["greedy_rows"], agreement["exact"], agreement["cache_errors"], agreement["missing"]) == (9, 6, 1, 0)
    assert agreement["exact_match"] == pytest.approx(6 / 9)
    assert (pairs[6]["first_diff"], pairs[7]["first_diff"], pairs[0]["first_diff"]) == (2, 3, None)
    assert pairs[8]["exact_match"] is False and pairs[9]["exact_match"] is None  # fp16's error: no reference
    assert not pairs[10]["greedy"] and pairs[10]["exact_match"] is False
    assert agreement["mean_first_diff"] == pytest.approx(2.5)  # rows 6 and 7; the failed row 8 has no tokens
    assert summary["fp16"]["rows"] == 12 and summary["fp16"]["error_rows"] == 1 and summary[K2]["error_rows"] == 2
    assert summary["fp16"]["actor_s"] == pytest.approx(5.0)  # each shard's seconds once, not once per row
    assert summary["fp16"]["tokens_per_s"] == pytest.approx(44 / 5.0)
    assert (summary[K2]["eos"], summary[K2]["length"]) == (1, 9)
    assert run == {"kind": "generate", "generations": 24, "generation_errors": 3, "results": 0}


@pytest.mark.parametrize("limit, test, passes", [(0.9, "regression", True), (0.95, "regression", False),
                                                 (0.2, "non_inferiority", True), (0.5, "non_inferiority", False)])
def test_min_exact_match_judges_the_fraction_of_identical_greedy_rows_on_its_exact_interval(root, limit, test, passes):
    write_run(root)
    rule = MinExactMatch(name="same-as-fp16", kind="min_exact_match", min_fraction=limit, test=test)
    with Store(root) as store:
        (verdict,) = evaluate(store, "g", [rule])
    assert verdict.cache == K2 and verdict.observed == pytest.approx(6 / 9) and verdict.n == 9
    assert verdict.ci_low < 6 / 9 < verdict.ci_high and verdict.passed is passes
    assert "6 of 9 greedy rows identical to fp16 (1 of them errors under" in verdict.detail


@pytest.mark.parametrize("limit, says", [
    (0.9, "; n = 9 is too small: the interval lies above 0.9 only from 36 greedy rows, all identical"),
    (0.5, None),  # 6 identical rows could pass: the 9 fail on their own data
    (1.0, "; no n passes: an interval of a finite n never lies at 1"),
])
def test_a_non_inferiority_verdict_that_no_outcome_of_its_rows_could_pass_says_how_many_rows_would(root, limit, says):
    write_run(root)
    rule = MinExactMatch(name="same-as-fp16", kind="min_exact_match", min_fraction=limit, test="non_inferiority")
    with Store(root) as store:
        (verdict,) = evaluate(store, "g", [rule])
    assert not verdict.passed
    assert verdict.detail.endswith(says) if says else "too small" not in verdict.detail and "no n" not in verdict.detail


def test_min_exact_match_fails_closed_on_a_partial_run(root):
    write_run(root, k2_rows=range(0, 6))  # kivi-2's second shard never written
    rule = MinExactMatch(name="same-as-fp16", kind="min_exact_match", min_fraction=0.1)
    with Store(root) as store:
        (verdict,) = evaluate(store, "g", [rule])
    assert not verdict.passed and verdict.detail.startswith("incomplete: 6 of fp16's rows have no")


def test_the_report_of_a_generate_run_shows_rows_errors_agreement_and_lengths(root, tmp_path):
    write_run(root)
    with Store(root) as store:
        path = write_report(store, "g", tmp_path / "g")
    text = path.read_text()
    assert "## Generations" in text and "### Error rows" in text and "out_of_memory" in text
    assert "| kivi-k2v2-g32-r128 | 9           | 6         | 0.67" in text
    assert (tmp_path / "g" / "generation-lengths.png").stat().st_size > 0


def test_openai_results_stream_whole_in_input_order_and_a_failed_stream_leaves_nothing(root):
    writer = write_run(root)
    rows = [row("fp16", n, FP16_TOKENS, 1.0) for n in range(3)] + [row("fp16", 3, FP16_TOKENS, 1.0, "out_of_memory")]
    path = writer.openai_results_path("fp16")
    with writer.root.open_whole(path) as out:
        openai.write_results(out, [r | {"cache": "fp16"} for r in rows], "g", "smollm2-135m", STARTED)
    lines = [json.loads(line) for line in writer.root.read(path).to_pybytes().splitlines()]
    assert [line["custom_id"] for line in lines] == ["id0", "id1", "id2", "id3"]
    body = lines[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24}
    assert lines[3]["response"]["status_code"] == 500 and lines[3]["error"]["code"] == "out_of_memory"
    with pytest.raises(RuntimeError), writer.root.open_whole("openai/half.jsonl") as out:
        out.write(b"{}\n")
        raise RuntimeError("the driver stops mid-file")
    assert not writer.root.exists("openai/half.jsonl") and writer.root.glob("openai/*") == []
