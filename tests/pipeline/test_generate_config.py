"""kivi-eval generate refuses a bad option with one error line naming the field, its flag and the fix, before any
model weights load: from its flags, from a `kind: generate` file given to it or to `kivi-eval run`."""

import json

import pytest
import yaml

import pipeline.worker
from pipeline.archive import ArchiveWriter
from pipeline.cli import main

BATCH_LINE = {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}]}}


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "a", "prompt": "Hello"}) + "\n")
    (tmp_path / "batch.jsonl").write_text(json.dumps(BATCH_LINE) + "\n")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"rules": [
        {"name": "drop", "kind": "max_drop", "workload": "gsm8k", "margin": 2}]}))
    (tmp_path / "same.yaml").write_text(yaml.safe_dump({"rules": [
        {"name": "same", "kind": "min_exact_match", "min_fraction": 0.9}]}))

    def no_weights(*args, **kwargs):
        raise AssertionError("model weights loaded before the options were checked")

    monkeypatch.setattr(pipeline.worker, "load_model", no_weights)
    monkeypatch.chdir(tmp_path)
    return tmp_path


BASE = ["--input", "prompts.jsonl", "--output", "out", "--model", "smollm2-135m", "--no-ray"]


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "-1"], "temperature (--temperature): Input should be greater than or equal to 0"),
    (["--top-p", "0"], "top_p (--top-p): Input should be greater than 0"),
    (["--max-new-tokens", "0"], "max_new_tokens (--max-new-tokens): Input should be greater than 0"),
    (["--cache", "kivi-9"], "caches (--cache): unknown KIVI preset 'kivi-9'"),
    (["--cache", "fp16", "--cache", "fp16"], "caches (--cache): a cache is listed twice"),
    (["--stop", ""], "stop (--stop): an empty stop string"),
    (["--model", "smollm2-136m"], "model.spec (--model): model: 'smollm2-136m' is no packaged model"),
    (["--score-kl"], "score_kl (--score-kl): it scores KIVI outputs under fp16: add a KIVI cache"),
    (["--prompt-column", "text"], "prompt_column (--prompt-column): the input has no 'text' (fields of its first 1 records: id, prompt)"),
    (["--input", "nowhere.jsonl"], "input (--input): input nowhere.jsonl: no such file or folder"),
    (["--input", "batch.jsonl", "--id-column", "key"], "id_column (--id-column): the input is in the OpenAI batch format"),
    (["--gate", "rules.yaml", "--cache", "kivi-2"], "gate (--gate): rule 'drop': max_drop reads evaluation results"),
    (["--gate", "same.yaml", "--cache", "kivi-2"],
     "gate (--gate): rule 'same': min_exact_match compares each KIVI cache's greedy outputs with fp16's, and the run "
     "has no fp16: add --cache fp16"),
    (["--gate", "same.yaml", "--cache", "fp16", "--cache", "kivi-2", "--temperature", "0.8"],
     "gate (--gate): rule 'same': min_exact_match reads the rows generated greedily, and temperature 0.8 samples every "
     "row: gate a greedy run (--temperature 0)"),
    (["--output", "prompts.jsonl"], "output (--output): archive "),  # the rest: the test below
])
def test_a_bad_option_is_one_error_naming_its_flag_before_any_model_loads(inputs, capsys, flags, says):
    assert main(["generate", *BASE, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kivi-eval: error: kivi-eval generate: ") and says in err and len(err.splitlines()) == 1


def test_an_archive_under_a_file_is_refused_naming_the_file(inputs, capsys):
    for output in ("prompts.jsonl", "prompts.jsonl/runs"):
        assert main(["generate", *BASE, "--output", output]) == 2
        assert f"{inputs / 'prompts.jsonl'} is a file, not a folder; name a folder" in capsys.readouterr().err
    assert (inputs / "prompts.jsonl").is_file()


@pytest.mark.parametrize("flags, room", [(["--max-new-tokens", "8192"], 8192),  # the model's own positions
                                         (["--max-new-tokens", "100", "--max-context", "100"], 100)])
def test_new_tokens_that_fill_the_context_are_refused_before_any_weights_load(inputs, capsys, flags, room):
    assert main(["generate", *BASE, *flags]) == 2
    err = capsys.readouterr().err
    assert (f"max_new_tokens (--max-new-tokens): {flags[1]} new tokens a row leave no room for a prompt in the "
            f"{room}-token context of smollm2-135m; lower it") in err
    assert not (inputs / "out").exists()


def test_an_evaluation_runs_id_is_refused_as_a_generate_resume(inputs, capsys):
    ArchiveWriter("out", "s1").write_run({"kind": "smoke", "model": "smollm2-135m", "config_yaml": "kind: smoke\n"})
    assert main(["generate", *BASE, "--run-id", "s1"]) == 2
    assert "is a smoke run, and this config's kind is generate: resume it with a smoke config" in capsys.readouterr().err


def test_a_required_option_left_out_is_named_with_its_flag(inputs, capsys):
    assert main(["generate", "--input", "prompts.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "output (--output): Field required" in err and "model.spec (--model): Field required" in err


def test_sampling_on_a_cache_the_decode_engine_does_not_hold_is_refused_before_any_weights_load(inputs, capsys):
    assert main(["generate", *BASE, "--cache", "token-keys-2", "--temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert "temperature (--temperature): kivi-k2v2-g32-r128-ktoken generates with transformers.generate" in err
    assert not (inputs / "out").exists()  # nothing written


def test_a_generate_config_file_is_checked_the_same_way_by_generate_and_by_run(inputs, capsys):
    config = inputs / "gen.yaml"
    config.write_text(yaml.safe_dump({"kind": "generate", "input": "prompts.jsonl", "output": "out",
                                      "model": {"spec": "smollm2-135m"}, "temprature": 0.5}))
    for command in (["generate", "--config", str(config)], ["run", str(config)]):
        assert main(command) == 2
        assert "gen.yaml: temprature: unknown field (did you mean 'temperature'?)" in capsys.readouterr().err
