"""kivi-eval generate in one process on a tiny random Llama (with SmolLM2's tokenizer): bad rows of every kind become
error rows while the rest generate, a batch out of memory is retried a row at a time, sampled rows reproduce
whatever the slots or the run, chat messages go through the template, stop strings end rows, KIVI outputs get
their KL under fp16."""

import io
import json
import sys

import pytest
import torch

import pipeline.engine
from pipeline.generation.config import load_generate_config
from pipeline.generation.runner import generate
from pipeline.store import Store

K2R0 = "kivi-k2v2-g32-r0"


@pytest.fixture(scope="module")
def model(tiny_model_folder):
    return str(tiny_model_folder(64, vocab_size=2048))


def run(tmp_path, model: str, records: list, run_id: str = "g", **flags) -> tuple:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    fields = {"input": str(path), "output": str(tmp_path / "out"), "model.spec": model, "max_new_tokens": 6,
              "batch_size": 3, "ray.shard_size": 4, **flags}
    summary = generate(load_generate_config(None, **fields), run_id, progress=False, in_process=True)
    with Store(tmp_path / "out") as store:
        rows = store.records("SELECT * FROM generations WHERE run_id = $1 ORDER BY cache, row", [run_id])
        manifest = store.records("SELECT generation FROM runs WHERE run_id = $1", [run_id])[0]
    return summary, rows, json.loads(manifest["generation"])


def prompts(n: int) -> list[dict]:
    return [{"id": f"r{i}", "prompt": f"Tell me about the number {i} and why it matters."} for i in range(n)]


def test_bad_rows_of_every_kind_are_recorded_and_counted_while_the_others_generate(tmp_path, model):
    records = prompts(5) + [{"id": "r1", "prompt": "again"}, {"prompt": "no id"}, {"id": "e", "prompt": " "},
                            {"id": "n", "prompt": 7}, "{not json", {"id": "long", "prompt": "word " * 80}]
    summary, rows, manifest = run(tmp_path, model, records, caches=["fp16", "kivi-2-r0"], score_kl=True,
                                  **{"model.max_context": 64})
    codes = {(r["cache"], r["row"]): r["error_code"] for r in rows}
    bad = {5: "duplicate_id", 6: "missing_id", 7: "empty_prompt", 8: "invalid_prompt", 9: "invalid_json",
           10: "prompt_too_long"}
    for cache in ("fp16", K2R0):
        assert [codes[(cache, n)] for n in range(11)] == [None] * 5 + list(bad.values())
    expected = {code: 1 for code in bad.values()}
    assert summary.counts["fp16"] == {"rows": 11, "output_tokens": 30, "errors": dict(sorted(expected.items()))}
    assert manifest["caches"] == summary.counts and manifest["input"]["rows"] == 11
    good = [r for r in rows if r["error_code"] is None]
    assert all(r["output_tokens"] == len(r["output_token_ids"]) == 6 and r["finish_reason"] == "length" for r in good)
    by_row = {}
    for r in good:
        by_row.setdefault(r["row"], []).append(r)
    assert all(a["prompt_hash"] == b["prompt_hash"] and a["prompt_tokens"] == b["prompt_tokens"] for a, b in by_row.values())
    kls = [r["kl_to_fp16"] for r in good if r["cache"] == K2R0]
    assert all(kl > 0 for kl in kls) and all(r["kl_to_fp16"] is None for r in good if r["cache"] == "fp16")
    assert "exceed the context of 64" in next(r["error"] for r in rows if r["row"] == 10)


def test_a_batch_out_of_memory_is_retried_a_row_at_a_time_and_a_row_that_still_does_not_fit_is_recorded(
        tmp_path, model, monkeypatch):
    _, plain, _ = run(tmp_path, model, prompts(6), run_id="plain")
    generate_calls = []
    real = pipeline.engine.Engine.generate

    def tight(self, requests, kivi, batch_size):
        generate_calls.append(len(requests))
        if len(requests) > 1 or "number 4" in requests[0].prompt:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, requests, kivi, batch_size)

    monkeypatch.setattr(pipeline.engine.Engine, "generate", tight)
    _, rows, _ = run(tmp_path, model, prompts(6), run_id="tight")
    assert generate_calls == [4, 1, 1, 1, 1, 2, 1, 1]  # each shard's batch, then its rows alone
    assert [r["error_code"] for r in rows] == [None] * 4 + ["out_of_memory", None]
    assert [r["output_token_ids"] for r in rows if r["row"] != 4] == [r["output_token_ids"] for r in plain if r["row"] != 4]


def test_sampled_rows_draw_the_same_whatever_the_slots_and_another_seed_draws_again(tmp_path, model):
    sampled = dict(temperature=1.0, top_p=0.95, top_k=50)
    _, two_slots, _ = run(tmp_path, model, prompts(7), run_id="a", batch_size=2, **sampled)
    _, five_slots, _ = run(tmp_path, model, prompts(7), run_id="b", batch_size=5, **{"ray.shard_size": 7}, **sampled)
    _, reseeded, _ = run(tmp_path, model, prompts(7), run_id="c", seed=1, **sampled)
    _, greedy, _ = run(tmp_path, model, prompts(7), run_id="d")
    tokens = [[r["output_token_ids"] for r in rows] for rows in (two_slots, five_slots, reseeded, greedy)]
    assert tokens[0] == tokens[1]  # other slots, other shards, the same draws
    assert tokens[0] != tokens[2] and tokens[0] != tokens[3]
    assert len({r["seed"] for r in two_slots}) == 7 and {r["temperature"] for r in two_slots} == {1.0}


def test_chat_messages_go_through_the_template_and_a_stop_string_ends_its_row(tmp_path, model):
    messages = [{"id": f"m{i}", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": f"Name {i} colours."}]} for i in range(3)]
    _, first, _ = run(tmp_path, model, messages, run_id="m", messages_column="messages")
    assert all(r["prompt_tokens"] > 12 and r["error_code"] is None for r in first)  # the template's tokens too
    text = first[0]["output_text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    _, stopped, _ = run(tmp_path, model, messages, run_id="s", messages_column="messages", stop=[stop])
    assert stopped[0]["finish_reason"] == "stop" and stopped[0]["output_text"] == text[: text.index(stop)]
    assert stopped[0]["output_tokens"] < first[0]["output_tokens"]


def screen(terminal: str) -> list[str]:
    """The lines a terminal shows for ``terminal``: a carriage return writes over the line from its start."""
    lines = []
    for raw in terminal.split("\n"):
        shown = ""
        for part in raw.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return lines


def test_a_worker_in_this_process_prints_its_shard_lines_above_the_progress_bar_not_across_it(
        tmp_path, model, monkeypatch):
    terminal = io.StringIO()  # stdout and stderr (the bar) on one terminal, as on a developer's machine
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in prompts(8)) + "\n")
    config = load_generate_config(None, input=str(path), output=str(tmp_path / "out"), **{"model.spec": model},
                                  max_new_tokens=2, batch_size=4, **{"ray.shard_size": 4})
    generate(config, "g", progress=True, in_process=True)
    shard_lines = [line for line in screen(terminal.getvalue()) if "generate shard" in line]
    assert len(shard_lines) == 2  # 2 shards of fp16 (the default cache)
    assert all(line.startswith("generate shard ") for line in shard_lines), shard_lines
