"""Which engine a run's caches generate with is decided before any weights load, said once on the console
and kept in the manifest; a cache the static cache cannot hold generates through transformers.generate."""

import json

import yaml

from pipeline.cli import main
from pipeline.store import Store


def test_a_cache_the_decode_engine_cannot_hold_falls_back_to_generate_and_the_manifest_says_why(
        tiny_model_folder, data_dir, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(dict(
        kind="smoke", model={"spec": str(tiny_model_folder(64)), "max_context": 1024}, caches=["kivi-2", "token-keys-2"],
        workloads={"gsm8k": {"n": 3, "num_fewshot": 1, "max_new_tokens": 6}}, data_dir=str(data_dir),
        archive=str(tmp_path / "archive"), reports=str(tmp_path / "reports"), generation={"batch_size": 2},
        ray={"shard_size": 3})))

    assert main(["run", str(config), "--no-ray"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "generating with transformers.generate" in line]
    assert len(lines) == 1 and lines[0].startswith("kivi-k2v2-g32-r128-ktoken: ") and "key_axis" in lines[0]
    with Store(tmp_path / "archive") as store:
        (run,) = store.records("SELECT * FROM runs")
        counts = store.records("SELECT cache, count(prediction) AS n FROM results GROUP BY cache ORDER BY cache")
    assert list(json.loads(run["fallbacks"])) == ["kivi-k2v2-g32-r128-ktoken"]
    assert counts == [{"cache": "fp16", "n": 3}, {"cache": "kivi-k2v2-g32-r128", "n": 3},
                      {"cache": "kivi-k2v2-g32-r128-ktoken", "n": 3}]
