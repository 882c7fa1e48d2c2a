"""Bad input gets one clear message naming the field, before any model loads, and writes nothing."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from s3_server import free_ports

from pipeline.config import ConfigError, load_config
from pipeline.gate import check_config_rules, load_gate

MODEL = {"spec": "smollm2-135m"}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _kivi_eval_run(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(config)], capture_output=True, text=True)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(workloads={"gsm8": {"n": 2}}), "workloads.gsm8: Unknown workload 'gsm8' (did you mean 'gsm8k'?)"),
        (dict(workloads={"gsm8k": {"n": 0}}), "workloads.gsm8k: workload 'gsm8k': option 'n'"),
        (dict(caches=["kivi-2"], cache_overrides={"kivi-2": {"residual_length": 100}}, workloads={"gsm8k": {"n": 2}}),
         "caches: KiviConfig.residual_length=100 must be >= 0 and a multiple of group_size=32; use 96 or 128"),
        (dict(caches=["kivi2"], workloads={"gsm8k": {"n": 2}}), "did you mean 'kivi-2'"),
        (dict(caches=["fp16", "kivi-2"], workloads={"gsm8k": {"n": 2}}), "fp16 is always run as the baseline"),
        (dict(kind="canary", workloads={"gsm8k": {"n": 2}}), "baseline_run_id: a canary needs the baseline run"),
        (dict(model={"spec": "random:llama-9b"}, workloads={"gsm8k": {"n": 2}}), "model.spec: model: unknown shape 'llama-9b'"),
        (dict(workloads={"gsm8k": {"n": 2}}, gate="missing-rules.yaml"), "gate: no gate rules file"),
        (dict(caches=["kivi-2"], cache_overrides={"kivi-2": {"sink_tokens": 4}}, workloads={"sharegpt": {"n": 2}}),
         "caches: kivi-k2v2-g32-r128-s4 cannot run the sharegpt sweep on the static decode engine: sink_tokens=4"),
    ],
)
def test_a_bad_config_names_the_field_and_the_fix(write_config, data_dir, fields, message):
    path = write_config(model=fields.pop("model", MODEL), data_dir=str(data_dir), **fields)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


GSM8K = {"gsm8k": {"n": 2}}


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(generaton={"batch_size": 2}), "generaton: unknown field (did you mean 'generation'?)"),
        (dict(generation={"batch_sise": 2}), "generation.batch_sise: unknown field (did you mean 'batch_size'?)"),
        (dict(kind="nighty"), "kind: Input should be 'smoke', 'nightly' or 'canary' (did you mean 'nightly'?)"),
        (dict(model={"spec": "smollm2-135m", "dtype": "float23"}), "or 'float16' (did you mean 'float32'?)"),
        (dict(model={"spec": "smollm2-136m"}), "model.spec: model: 'smollm2-136m' is no packaged model"),
        (dict(model={"spec": "smollm2-136m"}), "(did you mean 'smollm2-135m'?)"),
        (dict(model={"spec": "random:llama-2-7", "tokenizer": "smollm2-135m"}), "(did you mean 'random:llama-2-7b'?)"),
        (dict(model={"spec": "random:llama-2-7b"}), "model.tokenizer: random:llama-2-7b has random weights and no tokenizer"),
        (dict(model={"spec": "random:llama-2-7b", "tokenizer": "smolm2-135m"}), "model.tokenizer: model: 'smolm2-135m'"),
        (dict(cache_overrides={"kivi-2": {"k_bit": 4}}),
         "cache_overrides.kivi-2.k_bit: not a KiviConfig field (did you mean 'k_bits'?)"),
        (dict(cache_overrides={"kivi2": {"k_bits": 4}}),
         "cache_overrides.kivi2: not in caches ['kivi-2', 'kivi-4'] (did you mean 'kivi-2'?)"),
        (dict(workloads={"gsm8k": {"nn": 2}}), "workloads.gsm8k: workload 'gsm8k': option 'nn': unknown field (did you mean 'n'?)"),
        (dict(workloads={"longbench": {"tasks": ["qaspr"]}}), "unknown LongBench tasks ['qaspr'] (did you mean 'qasper'?)"),
        (dict(workloads={"gsm8k": {"n": 2, "data_dir": "/x"}}),
         "workloads.gsm8k.data_dir: data_dir is the config's top-level field"),
    ],
)
def test_a_misspelt_name_anywhere_in_the_config_gets_the_closest_valid_one(write_config, data_dir, fields, message):
    fields.setdefault("workloads", GSM8K)
    path = write_config(model=fields.pop("model", MODEL), data_dir=str(data_dir), **fields)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_a_hub_id_of_the_form_owner_slash_name_passes_validation_without_asking_the_hub(write_config, data_dir):
    path = write_config(model={"spec": "HuggingFaceTB/SmolLM2-135M-Instruct"}, data_dir=str(data_dir), workloads=GSM8K)
    assert load_config(path).model.spec == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_config_that_is_not_yaml_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("workloads: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML: .*line 2"):
        load_config(path)


def test_a_missing_data_folder_is_named(write_config, tmp_path):
    path = write_config(model=MODEL, data_dir=str(tmp_path / "nowhere"), workloads={"gsm8k": {"n": 2}})
    # The config's own field, not a workload option: data_dir is top-level (or KIVI_DATA_DIR).
    with pytest.raises(ConfigError, match=r"run.yaml: data_dir: no folder .*nowhere: point the config's top-level data_dir"):
        load_config(path)


def test_an_unreachable_hub_without_a_local_folder_says_to_set_data_dir(write_config, monkeypatch):
    monkeypatch.delenv("KIVI_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_config(model=MODEL, workloads={"gsm8k": {"n": 2}})
    with pytest.raises(ConfigError, match="workloads.gsm8k: .*data_dir"):
        load_config(path)


def test_the_cli_fails_fast_with_one_line_and_no_archive(write_config, data_dir, tmp_path):
    path = write_config(model=MODEL, data_dir=str(data_dir), workloads={"longbench": {"tasks": ["qaspr"]}})
    result = _kivi_eval_run(path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("kivi-eval: error:")]
    assert len(errors) == 1 and "workloads.longbench" in errors[0]
    assert not (tmp_path / "archive").exists()


def test_the_cpu_configs_validate_against_the_local_data(data_dir):
    for name in ("smoke.yaml", "ci.yaml", "sweep-h200.yaml", "multi-gpu.yaml"):
        config = load_config(CONFIGS / name, data_dir=str(data_dir))
        check_config_rules(config, CONFIGS / name)
        assert list(config.kivi_configs())[0] == "fp16"


def test_an_actor_needs_no_duckdb(data_dir):
    # GPU worker images carry Ray and torch; DuckDB is only the driver's (gate, report, queries).
    code = ("import sys; sys.modules['duckdb'] = None\n"
            "from pipeline.config import load_config\nimport pipeline.runner, pipeline.worker\n"
            f"load_config('{CONFIGS / 'smoke.yaml'}', data_dir='{data_dir}')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"kind": "max_drop", "workload": "mmlu", "margin": 2},
         "rule 'r': workload 'mmlu' is not in the config's workloads (gsm8k, longbench, sharegpt)"),
        ({"kind": "max_drop", "workload": "gsm8", "margin": 2}, "(did you mean 'gsm8k'?)"),
        ({"kind": "max_drop", "workload": "gsm8k", "cache": "kivi-k3v3-g32-r128", "margin": 2},
         "rule 'r': cache 'kivi-k3v3-g32-r128' is not run by the config (caches: kivi-k2v2-g32-r128)"),
        ({"kind": "max_drop", "workload": "longbench", "task": "qasper", "margin": 2},
         "rule 'r': task 'qasper' is not run by workload 'longbench' (tasks: trec)"),
        ({"kind": "max_drop", "workload": "sharegpt", "margin": 2},
         "rule 'r': workload 'sharegpt' is of kind 'throughput'; max_drop reads 'accuracy' or 'teacher_forced' workloads"),
        ({"kind": "max_kl", "max_kl": 0.1}, "rule 'r': workload 'fidelity' is not in the config's workloads"),
        ({"kind": "min_throughput_ratio", "workload": "gsm8k", "ratio": 1.0},
         "rule 'r': workload 'gsm8k' is of kind 'accuracy'; min_throughput_ratio reads 'throughput' workloads"),
    ],
)
def test_a_gate_rule_on_something_the_config_does_not_run_is_refused_before_any_model_loads(
        write_config, data_dir, tmp_path, rule, message):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"rules": [{"name": "r", **rule}]}))
    path = write_config(model=MODEL, data_dir=str(data_dir), caches=["kivi-2"], gate=str(rules),
                        workloads={"gsm8k": {"n": 2}, "longbench": {"subset": "mini", "tasks": ["trec"], "n": 1},
                                   "sharegpt": {"n": 2}})
    with pytest.raises(ConfigError) as err:
        check_config_rules(load_config(path), path)
    assert f"gate ({rules}): " in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("name, overrides", [("nightly.yaml", {}), ("canary.yaml", {"baseline_run_id": "nightly-1"})])
def test_the_shipped_gpu_configs_validate_with_their_gates_against_the_local_data(data_dir, name, overrides):
    # Their model is packaged apart (kivi-eval[qwen-coder-1-5b]); the rest validates as on the cluster.
    config = load_config(CONFIGS / name, data_dir=str(data_dir), model={"spec": "smollm2-135m", "max_context": 8192},
                         **overrides)
    check_config_rules(config, CONFIGS / name)
    assert load_gate(config.gate).rules and len(config.kivi_configs()) == 3


@pytest.mark.parametrize("archive, env, message", [
    ("nosuch://bucket/x", {}, "archive: archive nosuch://bucket/x: Unrecognized filesystem type in URI: nosuch://bucket/x; "
                              "use a folder, file://, s3://bucket/prefix"),
    ("s3://AKIA:secret@bucket/x", {}, "credentials in the URI would be kept in configs, logs and manifests"),
    ("s3://no-such-bucket/runs", {}, "bucket 'no-such-bucket' does not exist; create it (runs never create buckets)"),
    ("s3://{bucket}/runs", {"AWS_SECRET_ACCESS_KEY": "wrong"},
     "ACCESS_DENIED during HeadBucket operation: No response body.; check the endpoint (AWS_ENDPOINT_URL or the URI's "
     "endpoint_override) and the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"),
    ("s3://{bucket}/runs", {"AWS_ENDPOINT_URL": "http://127.0.0.1:{closed}"}, "check the endpoint (AWS_ENDPOINT_URL"),
])
def test_an_archive_that_cannot_be_reached_is_named_before_anything_runs(write_config, data_dir, s3_server, monkeypatch,
                                                                         archive, env, message):
    (closed,) = free_ports(1)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(closed=closed))
    path = write_config(model=MODEL, data_dir=str(data_dir), workloads={"gsm8k": {"n": 2}},
                        archive=archive.format(bucket=s3_server.bucket))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value) and "secret" not in str(err.value).split("would")[0]


def test_an_s3_archive_in_reach_validates(write_config, data_dir, s3_server):
    path = write_config(model=MODEL, data_dir=str(data_dir), workloads={"gsm8k": {"n": 2}},
                        archive=f"s3://{s3_server.bucket}/not-yet-written")
    assert load_config(path).archive == f"s3://{s3_server.bucket}/not-yet-written"
