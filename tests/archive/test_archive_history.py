"""kivi-eval history: a model's KIVI − fp16 deltas on one workload across runs, oldest first, with the store's
paired intervals and each run's gate result; a name without KIVI results is a one-line error naming the closest."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
from archive_files import copy
from synthetic_archive import CONFIG_YAML, K2, K4, MODEL, STARTED, result_row, write_gsm8k

from pipeline.archive import ArchiveWriter
from pipeline.cli import main
from pipeline.gate import evaluate, load_gate, write_verdicts
from pipeline.history import NoHistoryError, delta_history
from pipeline.names import FP16
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[2]
OTHER_MODEL = "qwen2.5-tiny"


def add_run(root: str, run_id: str, day: int, k2_correct: int, kind: str = "nightly", label: str | None = None) -> None:
    """A run ``day`` days after nightly-a: gsm8k only, fp16 and kivi-4 get 14 of 20 right, kivi-2 the first
    ``k2_correct`` (so its delta is −5 points per question it loses)."""
    writer = ArchiveWriter(root, run_id)
    writer.write_run({"kind": kind, "label": label, "model": MODEL, "config_yaml": CONFIG_YAML,
                      "started_at": STARTED + dt.timedelta(days=day)})
    for cache, correct in ((FP16, 14), (K2, k2_correct), (K4, 14)):
        write_gsm8k(writer, cache, correct=correct)
    writer.update_run_status("complete")


def gate_with(root: str, run_id: str, rules: Path, text: str) -> None:
    rules.write_text(text)
    with Store(root) as store:
        write_verdicts(root, run_id, evaluate(store, run_id, load_gate(rules)), rules)


# Passes with no drop at all (interval [0, 0]), fails on any loss at n=20 (the interval reaches past 3 points).
GSM8K_K2_RULE = f"rules:\n  - {{name: gsm8k-k2, kind: max_drop, workload: gsm8k, cache: {K2}, margin: 3, test: non_inferiority}}\n"
GSM8K_K4_RULE = f"  - {{name: gsm8k-k4, kind: max_drop, workload: gsm8k, cache: {K4}, margin: 3}}\n"


@pytest.fixture(scope="module")
def history_archive(shared_archive: str, new_root, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The shared archive (nightly-a on 2025-06-01, canary-b stamped when built) and three later nightlies,
    nightly-2 gated on gsm8k / kivi-2, nightly-3 on gsm8k / kivi-2 and kivi-4, nightly-1 by a rules file since
    deleted (its verdicts carry their workload); a nightly labelled long-ctx (a user's own series); and a run of
    another model."""
    tmp = tmp_path_factory.mktemp("history")
    root = new_root("history")
    copy(shared_archive, root)
    for day, k2_correct in ((1, 13), (2, 14), (3, 12)):
        add_run(root, f"nightly-{day}", day, k2_correct)
    gate_with(root, "nightly-2", tmp / "gsm8k.yaml", GSM8K_K2_RULE)
    gate_with(root, "nightly-3", tmp / "gsm8k-both.yaml", GSM8K_K2_RULE + GSM8K_K4_RULE)
    gate_with(root, "nightly-1", tmp / "gone.yaml", GSM8K_K2_RULE)
    (tmp / "gone.yaml").unlink()
    add_run(root, "long-ctx-1", 4, 10, label="long-ctx")
    other = ArchiveWriter(root, "other-1")
    for cache in (FP16, K2):
        other.write_results("gsm8k", cache, 0, [{**result_row(cache, "gsm8k", "g00", 1.0, "exact_match"),
                                                  "model": OTHER_MODEL, "workload_version": 3}])
    return root


def test_history_has_one_row_per_run_and_cache_oldest_first_with_the_views_statistics(history_archive) -> None:
    with Store(history_archive) as store:
        rows = delta_history(store, MODEL, "gsm8k")
        stats = {(s["run_id"], s["cache"]): s for s in store.records("SELECT * FROM kivi_delta_stats WHERE workload = 'gsm8k'")}
    assert [(r["run_id"], r["cache"]) for r in rows] == [(run, cache) for run in (
        "nightly-a", "nightly-1", "nightly-2", "nightly-3", "long-ctx-1", "canary-b") for cache in (K2, K4)]
    k2 = {r["run_id"]: r for r in rows if r["cache"] == K2}
    # nightly-a's kivi-2 errors on one request; nightly-3 loses two: exact McNemar on 2 discordant pairs is 0.5.
    assert {run: r["delta_points"] for run, r in k2.items()} == {
        "nightly-a": -5.0, "nightly-1": -5.0, "nightly-2": 0.0, "nightly-3": -10.0, "long-ctx-1": -20.0, "canary-b": 0.0}
    assert (k2["nightly-3"]["fp16_score"], k2["nightly-3"]["kivi_score"], k2["nightly-3"]["n_pairs"]) == (0.7, 0.6, 20)
    assert k2["nightly-3"]["p_value"] == pytest.approx(0.5)
    for r in rows:
        s = stats[(r["run_id"], r["cache"])]
        assert (r["ci_low"], r["ci_high"], r["p_value"]) == (s["ci_low"], s["ci_high"], s["p_value"])
    assert k2["nightly-3"]["ci_low"] < -10.0 and k2["nightly-3"]["ci_high"] <= 0.0
    assert k2["canary-b"]["kind"] == "canary" and k2["nightly-a"]["started_at"] == STARTED
    assert (k2["canary-b"]["label"], k2["long-ctx-1"]["label"]) == ("canary", "long-ctx")  # the kind by default


def test_history_gives_scores_in_the_units_of_kivi_deltas_and_deltas_in_points(history_archive) -> None:
    with Store(history_archive) as store:
        rows = delta_history(store, MODEL, "longbench")
        views = {(d["run_id"], d["cache"]): d for d in store.records("SELECT * FROM kivi_deltas WHERE workload = 'longbench'")}
    assert rows
    for r in rows:
        view = views[(r["run_id"], r["cache"])]
        assert (r["fp16_score"], r["kivi_score"]) == pytest.approx((view["fp16_score"], view["kivi_score"]))
        assert r["delta_points"] == pytest.approx(100 * (r["kivi_score"] - r["fp16_score"]))


def test_gate_passed_comes_from_the_rules_on_that_workload_and_cache_and_is_null_where_unknown(history_archive) -> None:
    with Store(history_archive) as store:
        rows = delta_history(store, MODEL, "gsm8k")
        longbench = delta_history(store, MODEL, "longbench")
    passed = {(r["run_id"], r["cache"]): r["gate_passed"] for r in rows}
    assert passed[("nightly-2", K2)] is True and passed[("nightly-3", K2)] is False
    assert passed[("nightly-2", K4)] is None  # its rule names kivi-2 only
    assert passed[("nightly-3", K4)] is True  # each cache its own verdicts
    assert passed[("nightly-1", K2)] is False  # its rules file is gone: the verdict names its workload
    assert passed[("nightly-a", K2)] is None  # never gated
    assert {r["gate_passed"] for r in longbench} == {None}  # gsm8k's rule says nothing of longbench


def test_cache_kind_and_last_narrow_the_rows_and_keep_the_oldest_first(history_archive) -> None:
    with Store(history_archive) as store:
        def runs(**kwargs) -> list[str]:
            return [r["run_id"] for r in delta_history(store, MODEL, "gsm8k", cache=K2, **kwargs)]
        assert runs() == ["nightly-a", "nightly-1", "nightly-2", "nightly-3", "long-ctx-1", "canary-b"]
        assert runs(kind="nightly") == ["nightly-a", "nightly-1", "nightly-2", "nightly-3", "long-ctx-1"]
        assert runs(label="nightly") == ["nightly-a", "nightly-1", "nightly-2", "nightly-3"]  # long-ctx is its own
        assert runs(label="long-ctx") == ["long-ctx-1"]
        assert runs(last=2) == ["long-ctx-1", "canary-b"]
        assert runs(kind="nightly", last=2) == ["nightly-3", "long-ctx-1"]
        assert [r["run_id"] for r in delta_history(store, OTHER_MODEL, "gsm8k")] == ["other-1"]


@pytest.mark.parametrize("names, says", [
    (dict(model="smollm2-136m", workload="gsm8k"),
     "with model 'smollm2-136m' in the archive {root} (did you mean 'smollm2-135m'?); models there: qwen2.5-tiny, smollm2-135m"),
    (dict(model=MODEL, workload="gsm8"),
     f"of model {MODEL} with workload 'gsm8' in the archive {{root}} (did you mean 'gsm8k'?); "
     "workloads there: gsm8k, longbench, niah"),
    (dict(model=OTHER_MODEL, workload="longbench"), f"of model {OTHER_MODEL} with workload 'longbench'"),
    (dict(model=MODEL, workload="gsm8k", cache="kivi-k2v2"), f"(did you mean 'kivi-2', '{K2}' or 'kivi-4'?)"),
    (dict(model=MODEL, workload="gsm8k", kind="nighty"), "(did you mean 'nightly'?); kinds there: canary, nightly"),
    (dict(model=MODEL, workload="gsm8k", label="long-ctz"),
     "(did you mean 'long-ctx'?); labels there: canary, long-ctx, nightly"),
    (dict(model=MODEL, workload="gsm8k", cache="kivi-3"),
     f"with cache 'kivi-3' in the archive {{root}} (did you mean 'kivi-4' or 'kivi-2'?); caches there: {K2} (kivi-2), "
     f"{K4} (kivi-4)"),
])
def test_a_name_without_deltas_is_an_error_naming_the_closest(history_archive, names, says) -> None:
    with Store(history_archive) as store, pytest.raises(NoHistoryError) as err:
        delta_history(store, **names)
    assert says.format(root=history_archive) in str(err.value)


def test_a_cache_is_named_by_its_preset_as_configs_name_it_or_by_its_archive_name(history_archive) -> None:
    with Store(history_archive) as store:
        by_preset = delta_history(store, MODEL, "gsm8k", cache="kivi-2")
        assert by_preset == delta_history(store, MODEL, "gsm8k", cache=K2) and {r["cache"] for r in by_preset} == {K2}


def test_the_command_prints_the_table_and_answers_a_typo_in_one_line(history_archive, capsys) -> None:
    common = ["--workload", "gsm8k", "--archive", str(history_archive)]
    assert main(["history", "--model", MODEL, *common, "--cache", "kivi-2", "--label", "nightly", "--last", "2"]) == 0
    header, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()]
    assert header == ["run_id", "kind", "label", "started_at", "cache", "fp16_score", "kivi_score", "delta_points",
                      "ci_low", "ci_high", "n_pairs", "p_value", "gate_passed"]
    assert [(r[0], r[5], r[6], r[7], r[-1]) for r in rows] == [("nightly-2", "0.7000", "0.7000", "0.0000", "True"),
                                                              ("nightly-3", "0.7000", "0.6000", "-10.0000", "False")]
    assert main(["history", "--model", "smollm2", *common]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kivi-eval: error: no KIVI result with model 'smollm2'") and "smollm2-135m" in line


def test_the_history_command_imports_neither_torch_nor_transformers_nor_ray(history_archive) -> None:
    code = (f"import sys; from pipeline.cli import main\n"
            f"code = main(['history', '--model', {MODEL!r}, '--workload', 'gsm8k', '--archive', {str(history_archive)!r}])\n"
            "print(code, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 []"
