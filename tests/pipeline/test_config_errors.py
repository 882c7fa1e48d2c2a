"""Bad input gets one clear message naming the field, before any model loads, and writes nothing."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub import constants
from s3_server import free_ports

from pipeline.cli import main as cli_main
from pipeline.config import ConfigError, load_config
from pipeline.gate import check_config_rules, load_gate
from pipeline.models import load_model_config
from pipeline.workloads import data as data_module
from pipeline.workloads import resolve_data_dir

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
         "cache_overrides.kivi-2: KiviConfig.residual_length=100 must be >= 0 and a multiple of group_size=32; use 96 or 128"),
        (dict(caches=["kivi2"], workloads={"gsm8k": {"n": 2}}), "did you mean 'kivi-2'"),
        (dict(caches=["fp16", "kivi-2"], workloads={"gsm8k": {"n": 2}}), "fp16 is always run as the baseline"),
        (dict(kind="canary", workloads={"gsm8k": {"n": 2}}), "baseline_run_id: a canary needs the baseline run"),
        (dict(model={"spec": "random:llama-9b"}, workloads={"gsm8k": {"n": 2}}), "model.spec: model: unknown shape 'llama-9b'"),
        (dict(workloads={"gsm8k": {"n": 2}}, gate="missing-rules.yaml"), "gate: no gate rules file missing-rules.yaml "
                                                                           "(a relative path is read from the working directory"),
        (dict(workloads={"gsm8k": {"n": 2}}, label="my run"), "label: String should match pattern"),
        (dict(caches=["kivi-2"], cache_overrides={"kivi-2": {"sink_tokens": 4}}, workloads={"sharegpt": {"n": 2}}),
         "caches: kivi-k2v2-g32-r128-s4 cannot run the sharegpt sweep on the static decode engine: sink_tokens=4"),
        (dict(workloads={"gsm8k": {"n": 2}}, archive=str(CONFIGS / "smoke.yaml" / "runs")),
         f"archive: archive {CONFIGS / 'smoke.yaml' / 'runs'}: {CONFIGS / 'smoke.yaml'} is a file, not a folder"),
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


def test_a_misspelt_kind_is_the_one_error_and_the_closest_kind_includes_generate(write_config, data_dir, capsys):
    for kind, closest in (("generat", "generate"), ("nighty", "nightly")):
        path = write_config(model=MODEL, data_dir=str(data_dir), workloads=GSM8K, kind=kind)
        assert cli_main(["run", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"kind: {kind!r} is none of smoke, nightly, canary, generate (did you mean {closest!r}?)")
        assert len(err.splitlines()) == 1


def test_model_folder_names_the_closest_packaged_model(capsys):
    assert cli_main(["model-folder", "smollm2-136m"]) == 2
    assert "model: 'smollm2-136m' is not a packaged model (did you mean 'smollm2-135m'?)" in capsys.readouterr().err


def test_a_default_read_from_a_field_that_failed_adds_no_problem_of_its_own(write_config, data_dir):
    path = write_config(model=MODEL, data_dir=str(data_dir), workloads=GSM8K, kind="nighty")  # label defaults to kind
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "label" not in str(err.value) and len(str(err.value).splitlines()) == 1


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


def test_an_unreachable_hub_says_where_a_run_looks_for_local_data(write_config, monkeypatch):
    monkeypatch.setenv("KIVI_DATA_DIR", "hub")  # the Hub even where ../shared/data exists
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    path = write_config(model=MODEL, workloads={"gsm8k": {"n": 2}})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert ("workloads.gsm8k: HF_HUB_OFFLINE is set, so dataset 'openai/gsm8k' cannot be read from the Hub: point data_dir "
            "at a local copy of the data sets (a run reads the config's data_dir, else $KIVI_DATA_DIR, else ../shared/data "
            "beside the checkout where it exists, else the Hugging Face Hub") in str(err.value)


@pytest.mark.parametrize("in_config, in_env, default_exists, found", [
    ("config", "env", True, "config"),
    (None, "env", True, "env"),
    (None, None, True, "default"),
    (None, None, False, None),  # the Hub
    ("hub", None, True, None),
    (None, "hub", True, None),
])
def test_the_data_folder_is_the_configs_then_kivi_data_dir_then_the_checkouts_neighbour_then_the_hub(
        tmp_path, monkeypatch, in_config, in_env, default_exists, found):
    folders = {name: tmp_path / name for name in ("config", "env", "default")}
    for name, folder in folders.items():
        if name != "default" or default_exists:
            folder.mkdir()
    monkeypatch.setattr(data_module, "DEFAULT_DATA_DIR", folders["default"])
    monkeypatch.delenv("KIVI_DATA_DIR", raising=False)
    if in_env:
        monkeypatch.setenv("KIVI_DATA_DIR", str(folders.get(in_env, in_env)))
    given = str(folders.get(in_config, in_config)) if in_config else None
    assert resolve_data_dir(given) == (folders[found] if found else None)


def test_the_default_data_folder_is_shared_data_beside_the_checkout():
    assert data_module.DEFAULT_DATA_DIR == CONFIGS.parents[1] / "shared" / "data"


def test_paths_in_a_config_are_read_from_the_working_directory_so_a_copied_config_runs_the_same(
        data_dir, tmp_path, monkeypatch):
    copied = tmp_path / "elsewhere" / "mine.yaml"
    copied.parent.mkdir()
    copied.write_text((CONFIGS / "smoke.yaml").read_text())
    monkeypatch.chdir(CONFIGS.parent)
    config = load_config(copied, data_dir=str(data_dir), archive=str(tmp_path / "archive"))
    assert config.gate == Path("configs/gates/smoke.yaml") and config.reports == Path("reports")


def test_a_gate_named_relative_to_the_config_as_before_is_refused_with_the_path_to_write(write_config, data_dir,
                                                                                        tmp_path, monkeypatch):
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "mine.yaml").write_text((CONFIGS / "gates" / "smoke.yaml").read_text())
    path = write_config(model=MODEL, data_dir=str(data_dir), workloads=GSM8K, gate="gates/mine.yaml")
    monkeypatch.chdir(CONFIGS.parent)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert (f"gate: no gate rules file gates/mine.yaml (a relative path is read from the working directory, "
            f"{CONFIGS.parent}); {tmp_path}/gates/mine.yaml is the file beside the config: write gate: "
            f"{tmp_path}/gates/mine.yaml") in str(err.value)


def test_the_label_names_the_runs_series_and_is_the_kind_unless_given(write_config, data_dir):
    assert load_config(write_config(model=MODEL, data_dir=str(data_dir), workloads=GSM8K, kind="smoke")).label == "smoke"
    config = load_config(write_config(model=MODEL, data_dir=str(data_dir), workloads=GSM8K, label="long-ctx"))
    assert (config.kind, config.label) == ("nightly", "long-ctx")


THREE_MISTAKES = """kind: smoke
model: {spec: smollm2-136m}
caches: [kivi-3]
workloads:
  gsm8: {n: 2}
"""


def test_three_mistakes_are_one_message_naming_each_field_and_its_fix(tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text(THREE_MISTAKES)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).splitlines() == [
        f"{path}: 3 problems:",
        "  model.spec: model: 'smollm2-136m' is no packaged model, random:<shape>, .gguf file, folder or Hub id "
        "(owner/name) (did you mean 'smollm2-135m'?); packaged: ['gemma-3-270m', 'qwen2.5-coder-0.5b', 'qwen2.5-coder-1.5b', 'smollm2-135m']",
        "  workloads.gsm8: Unknown workload 'gsm8' (did you mean 'gsm8k'?). Known: fidelity, gsm8k, longbench, niah, sharegpt",
        "  caches: unknown KIVI preset 'kivi-3' (did you mean 'kivi-8'?); presets: kivi-2, kivi-4, kivi-8, kivi-2-r32, "
        "kivi-2-r0, token-keys-2, token-keys-2-r0, unquantized",
    ]


def test_the_cli_reports_a_bad_config_before_importing_torch_or_transformers(tmp_path):
    path = tmp_path / "three.yaml"
    path.write_text(THREE_MISTAKES)
    code = ("import sys; from pipeline.cli import main\n"
            f"code = main(['run', {str(path)!r}])\n"
            "print(code, sorted(m for m in ('torch', 'transformers', 'ray', 'sklearn') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines()[-1] == "2 []", done.stderr
    assert done.stderr.startswith(f"kivi-eval: error: {path}: 3 problems:")


def test_validating_the_smoke_config_imports_no_torch(data_dir):
    code = ("import sys; from pipeline.config import load_config; from pipeline.gate import check_config_rules\n"
            f"config = load_config({str(CONFIGS / 'smoke.yaml')!r}, data_dir={str(data_dir)!r})\n"
            f"check_config_rules(config, {str(CONFIGS / 'smoke.yaml')!r})\n"
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'sklearn') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=CONFIGS.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


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


def test_a_random_shape_named_by_model_specs_builds_the_published_config():
    config = load_model_config("random:llama-3-8b")
    assert (config.model_type, config.num_key_value_heads, config.vocab_size) == ("llama", 8, 128256)
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert load_model_config("random:mistral-7b").sliding_window is None
