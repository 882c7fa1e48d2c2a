"""kivi-eval generate's input: SRC resolved and planned into shards that read back every row once (JSON lines by
byte range, Parquet by row groups, a Hub dataset by row range), duplicate ids found across files, unreadable input
refused; and each record turned into a row to generate or an error row with its code (columns, OpenAI batch lines)."""

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.generation import openai, source
from pipeline.generation.rows import ERROR_CODES, Options, from_columns, row_seed
from pipeline.generation.source import SourceError, plan, read_shard, resolve

OPTIONS = Options(max_new_tokens=8, temperature=0.5, top_p=0.9, top_k=20, seed=7, stop=("\n\n",))


def read_back(spec: str, shard_size: int, id_field: str = "id") -> tuple[source.InputPlan, list[tuple[int, object]]]:
    planned = plan(resolve(spec), "columns", id_field, shard_size)
    rows = [r for shard in planned.shards for r in read_shard(planned.source, shard)]
    return planned, rows


def test_json_lines_are_cut_into_byte_ranges_that_read_back_every_row_once(tmp_path, monkeypatch):
    records = [{"id": i, "prompt": f"line\u2028{i}" if i == 4 else f"p{i}"} for i in range(10)]
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    lines[2] += "\r"  # a CRLF line end
    text = "\n".join(lines[:3] + ["", "   "] + lines[3:7] + ["{broken"] + lines[7:])  # no newline at the end
    (tmp_path / "in.jsonl").write_text(text, encoding="utf-8")
    monkeypatch.setattr(source, "_BLOCK", 7)  # lines straddle the blocks the plan reads
    planned, rows = read_back(str(tmp_path / "in.jsonl"), shard_size=3)
    assert [n for n, _ in rows] == list(range(11)) and planned.rows == 11
    assert [s.rows for s in planned.shards] == [3, 3, 3, 2]
    assert [r for _, r in rows] == records[:7] + ["{broken"] + records[7:]


def test_parquet_files_of_a_folder_or_glob_are_numbered_in_path_order_and_read_by_row_groups(tmp_path):
    (tmp_path / "data").mkdir()
    for name, start, n in (("b.parquet", 0, 10), ("a.parquet", 100, 5)):
        pq.write_table(pa.table({"id": [f"q{start + i}" for i in range(n)], "prompt": ["x"] * n}),
                       tmp_path / "data" / name, row_group_size=4)
    (tmp_path / "data" / "notes.txt").write_text("not an input")
    for spec in (str(tmp_path / "data"), str(tmp_path / "data" / "*.parquet"), f"file://{tmp_path}/data"):
        planned, rows = read_back(spec, shard_size=3)
        assert planned.source.files == ("a.parquet", "b.parquet")
        assert [r["id"] for _, r in rows] == [f"q{100 + i}" for i in range(5)] + [f"q{i}" for i in range(10)]
        assert [n for n, _ in rows] == list(range(15))
        assert [(s.file, s.rows) for s in planned.shards] == [("a.parquet", 3), ("a.parquet", 2)] + [("b.parquet", 3)] * 3 + [("b.parquet", 1)]


def test_a_later_row_with_an_id_seen_before_is_marked_a_duplicate_of_the_first(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"id": i % 4, "prompt": "p"}) for i in range(6)) + "\n")
    pq.write_table(pa.table({"id": ["3", "x", "x"], "prompt": ["p"] * 3}), tmp_path / "b.parquet")
    planned = plan(resolve(str(tmp_path)), "columns", "id", 4)
    assert [s.duplicates for s in planned.shards] == [{}, {4: ("0", 0), 5: ("1", 1)}, {6: ("3", 3), 8: ("x", 7)}]
    assert planned.describe()["duplicate_ids"] == 4


def test_a_hub_dataset_is_read_in_row_ranges_of_its_split(monkeypatch):
    loaded = []

    def load_dataset(name, split):
        loaded.append((name, split))
        return datasets.Dataset.from_dict({"id": [f"h{i}" for i in range(7)], "prompt": [f"p{i}" for i in range(7)]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(source, "_HUB", {})
    src = resolve("owner/prompts", split="test")
    planned = plan(src, "columns", "id", 3)
    rows = [r for shard in planned.shards for r in read_shard(src, shard, ["prompt"])]
    assert loaded == [("owner/prompts", "test")]  # once per process
    assert [s.rows for s in planned.shards] == [3, 3, 1] and rows[4] == (4, {"prompt": "p4"})


def test_input_that_cannot_be_read_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "array.json").write_text('[{"id": 1, "prompt": "p"}]')
    with pytest.raises(SourceError, match=r"JSON array; .* jq -c"):
        source.sample_records(resolve(str(tmp_path / "array.json")))
    with pytest.raises(SourceError, match="no such file or folder, and not a Hugging Face dataset id"):
        resolve(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no .jsonl, .json, .ndjson, .parquet file there"):
        resolve(str(tmp_path / "empty"))
    pq.write_table(pa.table({"key": ["a"], "prompt": ["p"]}), tmp_path / "empty" / "x.parquet")
    with pytest.raises(SourceError, match=r"x.parquet has no column 'id' \(columns: key, prompt\); .*--id-column"):
        plan(resolve(str(tmp_path / "empty")), "columns", "id", 4)
    with pytest.raises(SourceError, match=r"x.parquet has no column 'text' .*--prompt-column or --messages-column"):
        plan(resolve(str(tmp_path / "empty")), "columns", "key", 4, ("text",))


def test_a_changed_input_has_another_fingerprint_and_its_shards_are_refused(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "prompt": "p"}) for i in range(6)) + "\n")
    planned = plan(resolve(str(path)), "columns", "id", 3)
    path.write_text("\n".join(json.dumps({"id": i, "prompt": "p"}) for i in range(4)) + "\n")
    assert plan(resolve(str(path)), "columns", "id", 3).fingerprint != planned.fingerprint
    with pytest.raises(SourceError, match="the input changed"):
        read_shard(planned.source, planned.shards[1])  # rows 3-5, where one row is left


@pytest.mark.parametrize("record, duplicate, code", [
    ("{broken", None, "invalid_json"), ({"prompt": "p"}, None, "missing_id"), ({"id": 1.5, "prompt": "p"}, None, "invalid_id"),
    ({"id": "a", "prompt": "p"}, ("a", 0), "duplicate_id"), ({"id": "a"}, None, "missing_prompt"),
    ({"id": "a", "prompt": ["p"]}, None, "invalid_prompt"), ({"id": "a", "prompt": "  \n"}, None, "empty_prompt"),
    ({"id": "a", "messages": "hi"}, None, "invalid_prompt"),
    ({"id": "a", "messages": [{"role": "user", "content": [{"type": "image"}]}]}, None, "invalid_prompt"),
    ({"id": "a", "messages": [{"role": "user", "content": " "}]}, None, "empty_prompt"),
])
def test_each_bad_record_becomes_an_error_row_with_its_code(record, duplicate, code):
    messages = "messages" if isinstance(record, dict) and "messages" in record else None
    row = from_columns(3, record, "id", "prompt", messages, OPTIONS, duplicate)
    assert row.error_code == code and row.error and code in ERROR_CODES and row.row == 3


def test_a_good_record_takes_the_runs_options_and_a_seed_of_its_own():
    a, b = (from_columns(n, {"id": key, "prompt": "Hello"}, "id", "prompt", None, OPTIONS, None) for n, key in ((0, "a"), (1, 7)))
    assert (a.id, a.prompt, a.max_new_tokens, a.stop, a.error_code) == ("a", "Hello", 8, ("\n\n",), None)
    assert (a.sampling.temperature, a.sampling.top_p, a.sampling.top_k) == (0.5, 0.9, 20)
    assert b.id == "7" and a.sampling.seed == row_seed(7, "a") != b.sampling.seed == row_seed(7, "7")
    assert row_seed(8, "a") != row_seed(7, "a")  # another run seed, other draws


def batch_line(custom_id="c1", url="/v1/chat/completions", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "Hi"}], **body}}


def test_an_openai_batch_line_overrides_the_runs_options_for_its_row():
    row = openai.from_batch_line(0, batch_line(max_completion_tokens=3, max_tokens=99, temperature=0, top_k=-1,
                                               seed=11, stop="END", n=1, stream=False), OPTIONS, None)
    assert row.error_code is None and row.messages == ({"role": "user", "content": "Hi"},)
    assert (row.max_new_tokens, row.stop, row.sampling.temperature, row.sampling.top_k, row.sampling.seed) == (
        3, ("END",), 0, 0, 11)
    plain = openai.from_batch_line(1, batch_line("c2"), OPTIONS, None)
    assert (plain.max_new_tokens, plain.sampling.temperature, plain.sampling.seed) == (8, 0.5, row_seed(7, "c2"))


@pytest.mark.parametrize("line, code, says", [
    (batch_line(url="/v1/embeddings"), "unsupported", "only POST /v1/chat/completions"),
    (batch_line(n=2), "unsupported", "body.n=2"), (batch_line(tools=[]), "unsupported", "body.tools is not supported"),
    (batch_line(max_tokens=0), "invalid_option", "max tokens 0"), (batch_line(top_p=1.5), "invalid_option", "top_p=1.5"),
    (batch_line(stop=[""]), "invalid_option", "stop"), (batch_line(messages=[]), "empty_prompt", "body.messages"),
    ({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": "hi"}, "invalid_option", "body is str"),
])
def test_an_openai_batch_line_asking_what_is_not_done_becomes_an_error_row(line, code, says):
    row = openai.from_batch_line(0, line, OPTIONS, None)
    assert row.error_code == code and says in row.error
