"""kivi-eval generate on a real Ray head with two CPU actors and SmolLM2, fp16 and KIVI-2, 4 new tokens: a 1,000-row
JSON-lines file beside a Parquet folder, and an OpenAI batch file with sampled lines, each run with an actor killed
mid-run and the driver killed, then rerun: every row exactly once per cache, bad rows counted with their errors,
the same outputs (greedy and sampled) as a one-process run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.generation.config import load_generate_config
from pipeline.generation.runner import generate
from pipeline.store import Store
from pipeline.worker import CRASH_ONCE_ENV, crash_marker

pytestmark = pytest.mark.slow

K2 = "kivi-k2v2-g32-r128"
OPTIONS = dict(model={"spec": "smollm2-135m", "max_context": 48}, caches=["fp16", "kivi-2"], max_new_tokens=4,
               batch_size=64, ray={"num_actors": 2, "cpus_per_actor": 1})
BAD = {100: ({"id": "r7", "prompt": "again"}, "duplicate_id"), 300: ({"prompt": "no id"}, "missing_id"),
       500: ({"id": "blank", "prompt": ""}, "empty_prompt"), 700: ({"id": "num", "prompt": 12}, "invalid_prompt"),
       900: ({"id": "long", "prompt": "many words " * 30}, "prompt_too_long")}


def prompt_records() -> list[dict]:
    records = [{"id": f"r{i}", "prompt": f"{i} +"} for i in range(1000 - len(BAD))]
    for at, (record, _) in sorted(BAD.items()):
        records.insert(at, record)
    return records


def write_inputs(folder: Path, records: list[dict], parquet_rows: int) -> None:
    (folder / "parquet").mkdir(parents=True)
    (folder / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    for part in range(2):
        ids = [f"p{part}-{i}" for i in range(parquet_rows // 2)]
        pq.write_table(pa.table({"id": ids, "prompt": [f"Say {i}" for i in ids]}), folder / "parquet" / f"part-{part}.parquet")


def batch_lines() -> list[dict]:
    lines = []
    for i in range(21):
        body = {"messages": [{"role": "user", "content": f"Give a word for {i}."}], "max_tokens": 3 + i % 2}
        if i % 3:  # two lines in three sample, some with their own seed
            body |= {"temperature": 1.0, "top_p": 0.9, **({"seed": 100 + i} if i % 2 else {})}
        lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    lines += [{"custom_id": "c3", "method": "POST", "url": "/v1/chat/completions", "body": lines[0]["body"]},
              {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
              {"custom_id": "many", "method": "POST", "url": "/v1/chat/completions", "body": {**lines[0]["body"], "n": 2}},
              {"method": "POST", "url": "/v1/chat/completions", "body": lines[0]["body"]}]
    return lines


def config_file(tmp_path: Path, name: str, src: Path, shard_size: int, address: str | None) -> Path:
    fields = dict(OPTIONS, kind="generate", input=str(src), output=str(tmp_path / "out"), reports=str(tmp_path / "reports"))
    fields["ray"] = dict(OPTIONS["ray"], shard_size=shard_size, address=address)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


def killed_then_resumed(config: Path, run_id: str, kill_after: int):
    """The driver (a `kivi-eval generate` process whose actor of shard 1 dies there once) killed once `kill_after`
    shard × cache files exist, then the run resumed here; returns (files before the rerun, the rerun's summary)."""
    out = Path(load_generate_config(config).output)
    files = lambda: sorted((out / "generations" / f"run_id={run_id}").rglob("shard-*.parquet"))  # noqa: E731
    env = {**os.environ, CRASH_ONCE_ENV: "generate:1"}
    driver = subprocess.Popen([str(Path(sys.executable).with_name("kivi-eval")), "generate", "--config", str(config),
                               "--run-id", run_id], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.time() + 600
    while len(files()) < kill_after and time.time() < deadline and driver.poll() is None:
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)  # no cleanup, no status update
    driver.wait()
    assert (out / crash_marker(run_id, "generate", 1)).exists(), "the actor's death was not injected"
    before = len(files())
    summary = generate(load_generate_config(config), run_id, progress=False)
    return before, summary


def rows_of(out: Path, run_id: str) -> list[dict]:
    with Store(out) as store:
        return store.records("SELECT cache, row, id, output_token_ids, error_code, temperature, seed FROM generations "
                             "WHERE run_id = $1 ORDER BY cache, row", [run_id])


def by_id(rows: list[dict]) -> dict:
    return {(r["cache"], r["id"]): r["output_token_ids"] for r in rows if r["error_code"] is None}


def test_a_jsonl_file_and_a_parquet_folder_killed_twice_and_rerun_give_each_row_once_and_the_one_process_outputs(
        tmp_path, ray_head):
    records = prompt_records()
    write_inputs(tmp_path / "data", records, parquet_rows=40)
    config = config_file(tmp_path, "all", tmp_path / "data", shard_size=120, address=ray_head[0])
    before, summary = killed_then_resumed(config, "jl", kill_after=4)
    total_files = 2 * (2 + 9)  # parquet: a shard per file; prompts.jsonl: 1,000 rows in shards of 120
    assert 0 < before < total_files and summary.reused >= before and summary.reused + len(summary.computed) == total_files

    rows = rows_of(tmp_path / "out", "jl")
    assert len(rows) == len({(r["cache"], r["row"]) for r in rows}) == 2 * 1040  # every row once per cache
    codes = {(r["cache"], r["id"], r["row"]): r["error_code"] for r in rows if r["error_code"]}
    expected = {(cache, record.get("id"), 40 + at): code for cache in ("fp16", K2) for at, (record, code) in BAD.items()}
    assert codes == expected
    assert summary.counts[K2]["errors"] == {code: 1 for _, code in BAD.values()}
    assert summary.counts["fp16"]["rows"] == 1040
    assert summary.counts["fp16"]["output_tokens"] == sum(len(r["output_token_ids"] or []) for r in rows if r["cache"] == "fp16")

    # One process, no Ray, on an excerpt (the Parquet folder, the first 120 lines and the bad ones): the same rows.
    write_inputs(tmp_path / "excerpt", records[:120] + [b for b, _ in BAD.values()], parquet_rows=40)
    local = config_file(tmp_path, "excerpt", tmp_path / "excerpt", shard_size=120, address=None)
    generate(load_generate_config(local), "one-process", progress=False, in_process=True)
    reference = rows_of(tmp_path / "out", "one-process")
    mine, theirs = by_id(rows), by_id(reference)
    assert len(theirs) == 2 * (40 + 119) and all(mine[key] == tokens for key, tokens in theirs.items())
    assert {(r["cache"], r["id"]): r["error_code"] for r in reference if r["error_code"]} == {
        (cache, record.get("id")): code for cache in ("fp16", K2) for record, code in BAD.values()}


def test_an_openai_batch_file_killed_twice_and_rerun_gives_every_line_once_and_the_same_draws_as_one_process(
        tmp_path, ray_head):
    path = tmp_path / "batch.jsonl"
    lines = batch_lines()
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    config = config_file(tmp_path, "batch", path, shard_size=4, address=ray_head[0])
    _, summary = killed_then_resumed(config, "oa", kill_after=4)
    rows = rows_of(tmp_path / "out", "oa")
    assert len(rows) == len({(r["cache"], r["row"]) for r in rows}) == 2 * len(lines)
    assert summary.counts["fp16"]["errors"] == {"duplicate_id": 1, "missing_id": 1, "unsupported": 2}

    generate(load_generate_config(config_file(tmp_path, "local", path, 25, None)), "local", progress=False, in_process=True)
    reference = rows_of(tmp_path / "out", "local")
    assert by_id(rows) == by_id(reference)  # greedy and sampled lines alike
    sampled = [r for r in rows if r["temperature"] > 0 and r["error_code"] is None]
    assert len(sampled) == 2 * 14 and {r["seed"] for r in sampled if r["id"] == "c1"} == {101}

    results = [json.loads(line) for line in Path(summary.openai_results[K2]).read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [line.get("custom_id") for line in lines]
    assert [r["response"]["status_code"] for r in results] == [200] * 21 + [400] * 4
    tokens = {r["id"]: r["output_token_ids"] for r in rows if r["cache"] == K2 and r["error_code"] is None}
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == len(tokens[r["custom_id"]]) for r in results[:21])
