"""Gate rules: YAML validation, verdicts and intervals as hand-computed on the synthetic archive, fail-closed, exit code."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from archive_files import listing, remove, write_parquet
from synthetic_archive import K2, K4, MODEL, result_row, write_gsm8k

from pipeline.archive import ArchiveWriter
from pipeline.gate import (
    GateConfigError,
    Verdict,
    evaluate,
    exit_code,
    load_gate,
    parse_gate,
    write_verdicts,
)
from pipeline.names import FP16
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[2]


def rules(*specs: dict):
    return parse_gate({"rules": [{"name": f"r{i}", **s} for i, s in enumerate(specs)]}).rules


def outcome(verdicts: list[Verdict]) -> dict[tuple[str, str | None], bool]:
    return {(v.rule, v.cache): v.passed for v in verdicts}


@pytest.fixture(scope="module")
def store(shared_archive: str) -> Store:
    with Store(shared_archive) as s:
        yield s


@pytest.mark.parametrize("name", ["nightly", "canary", "smoke", "reproducible"])
def test_the_example_gate_files_load(name: str) -> None:
    assert load_gate(REPO / "configs" / "gates" / f"{name}.yaml").rules


def test_a_missing_or_malformed_rules_file_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(GateConfigError, match=r"nope.yaml: no such gate rules file"):
        load_gate(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("rules: [\n")
    with pytest.raises(GateConfigError, match=r"bad.yaml: not valid YAML"):
        load_gate(tmp_path / "bad.yaml")


def test_an_unknown_rule_kind_is_refused_with_a_suggestion_and_the_valid_kinds() -> None:
    with pytest.raises(GateConfigError, match=r"rules\[0\] \(r0\)\.kind: 'max_dropp' is not a rule kind \(did you mean "
                                              r"'max_drop'\?\); valid kinds: max_drop, max_kl, cells_equal"):
        rules({"kind": "max_dropp", "workload": "gsm8k", "margin": 2})


def test_a_bad_rule_kind_does_not_hide_the_other_rules_mistakes() -> None:
    with pytest.raises(GateConfigError) as err:
        rules({"kind": "max_dropp", "workload": "gsm8k", "margin": 2}, {"kind": "max_drop", "workload": "gsm8k", "margn": 2},
              {"workload": "gsm8k"})
    problems = str(err.value).split("; ")
    assert problems[0].startswith("gate rules: rules[0] (r0).kind: 'max_dropp' is not a rule kind")
    assert "rules[1] (r1).margn: unknown field (did you mean 'margin'?)" in problems
    assert "rules[2] (r2).kind: missing" in problems


def test_a_misspelled_field_is_named_with_a_suggestion() -> None:
    with pytest.raises(GateConfigError, match=r"rules\[0\] \(r0\)\.margn: unknown field \(did you mean 'margin'\?\)"):
        rules({"kind": "max_drop", "workload": "gsm8k", "margn": 2})
    with pytest.raises(GateConfigError, match=r"rules\[0\] \(r0\)\.test: Input should be 'regression' or 'non_inferiority'"):
        rules({"kind": "max_drop", "workload": "gsm8k", "margin": 2, "test": "regresion"})


def test_a_negative_limit_a_missing_field_and_repeated_names_are_refused() -> None:
    with pytest.raises(GateConfigError, match=r"rules\[0\] \(r0\)\.margin: Input should be greater than or equal to 0"):
        rules({"kind": "max_drop", "workload": "gsm8k", "margin": -1})
    with pytest.raises(GateConfigError, match=r"rules\[0\] \(r0\)\.ratio: Field required"):
        rules({"kind": "min_throughput_ratio"})
    with pytest.raises(GateConfigError, match="repeated: \\['same'\\]"):
        parse_gate({"rules": [{"name": "same", "kind": "cells_equal"}, {"name": "same", "kind": "cells_equal"}]})


def test_the_nightly_gate_passes_and_fails_exactly_as_hand_computed(store: Store) -> None:
    verdicts = evaluate(store, "nightly-a", load_gate(REPO / "configs/gates/nightly.yaml"))
    assert outcome(verdicts) == {
        # kivi-2 errs on one question fp16 answers: a 5-point drop whose interval [0, 15] reaches below 3.
        ("gsm8k-drop", K2): True, ("gsm8k-drop-kivi4", K4): True,
        ("longbench-avg", K2): True, ("longbench-avg", K4): True,  # drops 0.75 [0, 2.25] and 0 points, margin 3
        ("niah-cells", K2): False, ("niah-cells", K4): True,  # kivi-2 lost cell (4096, 0.5)
        ("kl-kivi2", K2): False, ("kl-kivi4", K4): False,  # the archive has no fidelity workload: fail closed
        ("kivi2-throughput", K2): True,  # 1000 / 320 = 3.125x >= 1
    }
    by_rule = {(v.rule, v.cache): v for v in verdicts}
    gsm8k = by_rule[("gsm8k-drop", K2)]
    # One discordant pair: McNemar p = 1. A resample holds k ~ Binomial(20, 1/20) copies of it, a drop of 5k
    # points: P(k = 0) = 0.358 > 2.5% and P(k >= 4) = 0.016 < 2.5% <= P(k >= 3) = 0.075, so the interval is [0, 15].
    assert (gsm8k.observed, gsm8k.ci_low, gsm8k.ci_high, gsm8k.p_value, gsm8k.n) == (pytest.approx(5.0), 0.0, 15.0, 1.0, 20)
    assert gsm8k.detail == (
        "gsm8k: fp16 70.00, KIVI 65.00, drop 5.00 points (95% CI [0.00, 15.00], mcnemar p = 1, n = 20); past the limit "
        "of 3 points, but not significantly: the interval reaches back to 0.00, and a regression test fails only a harm "
        "the data show beyond its limit; n = 20 is too small for a 3-point limit: the smallest effect it finds with 80% "
        "power is 13.56 points")
    longbench = by_rule[("longbench-avg", K2)]
    assert (longbench.observed, longbench.ci_low, longbench.ci_high) == (pytest.approx(0.75), 0.0, pytest.approx(2.25))
    assert by_rule[("niah-cells", K2)].observed == 1.0 and by_rule[("kivi2-throughput", K2)].observed == pytest.approx(3.125)
    assert "niah L=4096 depth=0.5: fp16 1.00 vs 0.00" in by_rule[("niah-cells", K2)].detail
    assert by_rule[("kl-kivi2", K2)].detail == f"missing fidelity KL for {K2}"
    assert exit_code(verdicts) == 1


@pytest.mark.parametrize("spec, passed", [
    # gsm8k kivi-2: drop 5 [0, 15]. A regression test fails only when the whole interval is past the margin,
    # non-inferiority passes only when the whole interval is inside it.
    ({"kind": "max_drop", "workload": "gsm8k", "cache": K2, "margin": 0}, True),
    ({"kind": "max_drop", "workload": "gsm8k", "cache": K2, "margin": 15, "test": "non_inferiority"}, False),
    ({"kind": "max_drop", "workload": "gsm8k", "cache": K2, "margin": 15.01, "test": "non_inferiority"}, True),
    # At 60% the interval is [0, 10]: P(k >= 2) = 0.264 >= 20% > P(k >= 3).
    ({"kind": "max_drop", "workload": "gsm8k", "cache": K2, "margin": 10.01, "test": "non_inferiority", "confidence": 0.6}, True),
    ({"kind": "max_drop", "workload": "gsm8k", "cache": K2, "margin": 10.01, "test": "non_inferiority"}, False),
    ({"kind": "max_drop", "workload": "gsm8k", "cache": K4, "margin": 0.01, "test": "non_inferiority"}, True),
    # One timing per sweep point: no interval, so the point decides a regression test ...
    ({"kind": "min_throughput_ratio", "cache": K4, "ratio": 1.75}, True),
    ({"kind": "min_throughput_ratio", "cache": K4, "ratio": 1.76}, False),
    # ... and non-inferiority cannot be shown.
    ({"kind": "min_throughput_ratio", "cache": K4, "ratio": 1.0, "test": "non_inferiority"}, False),
    ({"kind": "cells_equal", "cache": K2, "tolerance_points": 100}, True),
])
def test_each_test_judges_the_interval_against_its_limit(store: Store, spec: dict, passed: bool) -> None:
    assert [v.passed for v in evaluate(store, "nightly-a", rules(spec))] == [passed]


@pytest.mark.parametrize("spec, passed, says", [
    ({"margin": 20}, True, "drop 5.00 points (95% CI [0.00, 15.00], mcnemar p = 1, n = 20); within the limit of 20 points"),
    ({"margin": 1}, True, "; past the limit of 1 point, but not significantly: the interval reaches back to 0.00"),
    ({"margin": 15, "test": "non_inferiority"}, False, "; not shown within the limit of 15 points: the interval reaches 15.00"),
    ({"margin": 16, "test": "non_inferiority"}, True, "; shown within the limit of 16 points: the whole interval lies within it"),
])
def test_each_verdict_says_why_it_passed_or_failed_in_a_sentence(store: Store, spec: dict, passed: bool, says: str) -> None:
    (verdict,) = evaluate(store, "nightly-a", rules({"kind": "max_drop", "workload": "gsm8k", "cache": K2, **spec}))
    assert verdict.passed is passed and says in verdict.detail


def test_a_verdict_on_one_request_says_the_point_estimate_decided_and_names_no_unknown_effect(tmp_path: Path) -> None:
    writer = ArchiveWriter(tmp_path, "one")
    for cache, score in ((FP16, 1.0), (K2, 0.0)):
        writer.write_results("gsm8k", cache, 0, [{**result_row(cache, "gsm8k", "g00", score, "exact_match"),
                                                   "model": MODEL, "workload_version": 3}])
    with Store(tmp_path) as store:
        wide, tight = evaluate(store, "one", rules({"kind": "max_drop", "workload": "gsm8k", "cache": K2, "margin": 150},
                                                   {"kind": "max_drop", "workload": "gsm8k", "cache": K2, "margin": 50}))
    assert wide.passed and not tight.passed
    assert wide.detail == ("gsm8k: fp16 100.00, KIVI 0.00, drop 100.00 points (no interval: one cluster, mcnemar p = 1, "
                           "n = 1); within the limit of 150 points: without an interval the point estimate decides; with "
                           "one cluster (n = 1) the verdict rests on a single value, whatever the limit")
    assert "past the limit of 50 points: without an interval" in tight.detail and "unknown" not in tight.detail


@pytest.mark.parametrize("spec, passed, says", [
    ({"ratio": 1.75}, True, "560.0 tokens/s (batch ≤ 32) vs fp16 320.0 (batch ≤ 16): 1.75× (no interval: one timing per "
                            "point); at or above the floor of 1.75×: without an interval the point estimate decides"),
    ({"ratio": 1.76}, False, "; below the floor of 1.76×: without an interval the point estimate decides"),
    ({"ratio": 1.0, "test": "non_inferiority"}, False,
     "; not shown at or above the floor of 1×: non-inferiority needs an interval, and one timing per point gives none"),
])
def test_a_throughput_verdict_says_why_in_the_same_words(store: Store, spec: dict, passed: bool, says: str) -> None:
    (verdict,) = evaluate(store, "nightly-a", rules({"kind": "min_throughput_ratio", "cache": K4, **spec}))
    assert verdict.passed is passed and says in verdict.detail


def test_a_rule_may_name_its_cache_by_preset_as_configs_do(store: Store) -> None:
    by_preset = evaluate(store, "nightly-a", rules({"kind": "max_drop", "workload": "gsm8k", "cache": "kivi-2", "margin": 3}))
    assert [(v.cache, v.detail) for v in by_preset] == [
        (v.cache, v.detail) for v in evaluate(store, "nightly-a", rules({"kind": "max_drop", "workload": "gsm8k",
                                                                          "cache": K2, "margin": 3}))]


def test_repeated_timings_give_the_throughput_ratio_an_interval(tmp_path: Path) -> None:
    writer = ArchiveWriter(tmp_path, "timed")
    for cache, timings in ((FP16, [100.0, 104.0, 96.0]), (K2, [150.0, 165.0, 135.0])):
        writer.write_perf([{"model": MODEL, "cache": cache, "workload": "sharegpt", "batch_size": 8, "repeat": i,
                            "tokens_per_s": t, "kv_bytes": 1, "fp16_kv_bytes": 2, "oom": False} for i, t in enumerate(timings)])
    with Store(tmp_path) as store:
        (row,) = store.records("SELECT * FROM throughput WHERE cache = $1", [K2])
        verdicts = evaluate(store, "timed", rules({"kind": "min_throughput_ratio", "cache": K2, "ratio": 1.4},
                                                  {"kind": "min_throughput_ratio", "cache": K2, "ratio": 1.4,
                                                   "test": "non_inferiority"},
                                                  {"kind": "min_throughput_ratio", "cache": K2, "ratio": 1.6}))
    assert row["throughput_ratio"] == pytest.approx(1.5) and row["repeats"] == 3
    # Each side's mean over a resample of its 3 timings: the ratio spans (135/104, 165/96) at most.
    assert 135 / 104 - 1e-9 <= row["ratio_ci_low"] < 1.5 < row["ratio_ci_high"] <= 165 / 96 + 1e-9
    assert [v.passed for v in verdicts] == [True, row["ratio_ci_low"] >= 1.4, True]


@pytest.mark.parametrize("run_id, spec, detail", [
    ("nightly-a", {"kind": "max_drop", "workload": "ruler", "margin": 5}, "missing ruler scores"),
    ("nightly-a", {"kind": "max_drop", "workload": "gsm8k", "cache": "kivi-k8v8-g32-r128", "margin": 5}, "missing gsm8k scores"),
    ("nightly-a", {"kind": "max_drop", "workload": "longbench", "task": "qasper", "cache": K2, "margin": 5},
     "missing longbench/qasper"),
    ("nightly-a", {"kind": "cells_equal", "workload": "ruler"}, "missing ruler cells for fp16"),
    ("canary-b", {"kind": "min_throughput_ratio", "cache": K4, "ratio": 1.0}, "missing sharegpt throughput for kivi-k4v4"),
    ("nightly-a", {"kind": "no_regression_vs_baseline", "margin": 100}, "missing baseline"),
    ("nightly-a", {"kind": "max_kl", "max_kl": 1}, f"missing fidelity KL for {K2}"),
    ("never-ran", {"kind": "max_drop", "workload": "gsm8k", "margin": 100}, "missing: run never-ran has no KIVI cache"),
])
def test_a_metric_missing_from_the_archive_fails_closed(store: Store, run_id: str, spec: dict, detail: str) -> None:
    verdicts = evaluate(store, run_id, rules(spec))
    assert verdicts and not any(v.passed for v in verdicts)
    assert any(v.detail.startswith(detail) for v in verdicts), [v.detail for v in verdicts]
    assert exit_code(verdicts) == 1


def test_a_kivi_cache_that_answered_only_some_shards_fails_even_if_those_scores_match(root: str) -> None:
    writer = ArchiveWriter(root, "partial")
    write_gsm8k(writer, FP16, correct=10)
    write_gsm8k(writer, K2, correct=10, shards=(0,))  # identical answers, half the requests
    with Store(root) as store:
        (verdict,) = evaluate(store, "partial", rules({"kind": "max_drop", "workload": "gsm8k", "margin": 100}))
    assert not verdict.passed and verdict.detail.startswith("incomplete gsm8k: 10 paired requests of 20 fp16")


def test_the_canary_shows_non_inferiority_except_for_the_cache_whose_task_interval_reaches_past_the_margin(store: Store) -> None:
    verdicts = evaluate(store, "canary-b", rules({"kind": "no_regression_vs_baseline", "margin": 1.0,
                                                  "test": "non_inferiority"}))
    assert outcome(verdicts) == {("r0", FP16): True, ("r0", K2): False, ("r0", K4): True}
    failed = next(v for v in verdicts if not v.passed)
    # gov_report, two requests: drops of 0 and 3 points, a resample holds 0, 1 or 2 of the second: [0, 3].
    assert (failed.observed, failed.ci_low, failed.ci_high) == (pytest.approx(1.5), 0.0, pytest.approx(3.0))
    assert "longbench/gov_report" in failed.detail and "failing: longbench/gov_report −1.50" in failed.detail
    assert {v.baseline_run_id for v in verdicts} == {"nightly-a"}  # taken from canary-b's manifest


def test_the_canary_passes_a_regression_test_or_a_wider_margin_and_the_gate_exits_zero(store: Store) -> None:
    for spec in ({"margin": 1.0}, {"margin": 3.5, "test": "non_inferiority"}):
        verdicts = evaluate(store, "canary-b", rules({"kind": "no_regression_vs_baseline", **spec}))
        assert len(verdicts) == 3 and exit_code(verdicts) == 0, [v.detail for v in verdicts]


def test_an_explicit_baseline_overrides_the_manifest(store: Store) -> None:
    verdicts = evaluate(store, "nightly-a", rules({"kind": "no_regression_vs_baseline", "margin": 0,
                                                   "test": "non_inferiority"}), baseline_run_id="canary-b")
    # nightly-a vs canary-b is the reverse comparison: kivi-2 lost 5 gsm8k points.
    assert outcome(verdicts)[("r0", K2)] is False
    assert next(v.observed for v in verdicts if v.cache == K2) == pytest.approx(5.0)


def test_the_canary_fails_closed_when_the_candidate_lacks_a_baseline_workload(archive: str) -> None:
    remove(archive, "results/run_id=canary-b/workload=niah")
    with Store(archive) as store:
        verdicts = evaluate(store, "canary-b", rules({"kind": "no_regression_vs_baseline", "margin": 100}))
    assert not any(v.passed for v in verdicts) and all(v.detail.startswith("missing in candidate: niah") for v in verdicts)


def test_the_canary_refuses_to_compare_different_workload_versions(archive: str) -> None:
    for cache in (FP16, K2, K4):
        write_gsm8k(ArchiveWriter(archive, "canary-b"), cache, correct=14, version=4)
    with Store(archive) as store:
        verdicts = evaluate(store, "canary-b", rules({"kind": "no_regression_vs_baseline", "margin": 100}))
    assert not any(v.passed for v in verdicts)
    assert all("workload versions differ: gsm8k v4≠v3" in v.detail for v in verdicts)


def test_exit_code_is_zero_only_when_there_are_verdicts_and_all_passed() -> None:
    ok = Verdict("a", "max_drop", K2, 0.0, 1.0, True, "")
    bad = Verdict("b", "max_drop", K2, 2.0, 1.0, False, "")
    assert (exit_code([ok]), exit_code([ok, bad]), exit_code([])) == (0, 1, 1)


def test_written_verdicts_are_queryable_and_a_reevaluation_replaces_them(archive: str) -> None:
    path = REPO / "configs/gates/nightly.yaml"
    with Store(archive) as store:
        write_verdicts(archive, "nightly-a", evaluate(store, "nightly-a", load_gate(path)), path)
    write_verdicts(archive, "nightly-a", [Verdict("only", "max_drop", K2, 0.0, 1.0, True, "rerun")], path)
    with Store(archive) as store:
        assert store.query("SELECT rule, cache, passed, detail FROM verdicts WHERE run_id = 'nightly-a'")[1] == [
            ("only", K2, True, "rerun")]


def test_each_rules_file_keeps_its_own_verdicts_named_after_it(archive: str) -> None:
    smoke, nightly = REPO / "configs/gates/smoke.yaml", REPO / "configs/gates/nightly.yaml"
    with Store(archive) as store:
        write_verdicts(archive, "nightly-a", evaluate(store, "nightly-a", load_gate(smoke)), smoke)
        write_verdicts(archive, "nightly-a", evaluate(store, "nightly-a", load_gate(nightly)), nightly)
    write_verdicts(archive, "nightly-a", [Verdict("only", "max_drop", K2, 0.0, 1.0, True, "rerun")], nightly)
    with Store(archive) as store:
        counts = store.query("SELECT rules, rules_path, count(*) FROM verdicts GROUP BY ALL ORDER BY rules")[1]
    # The nightly gate ran last and was re-evaluated; the smoke gate's five verdicts are still there.
    assert counts == [("nightly", str(nightly), 1), ("smoke", str(smoke), 5)]
    assert listing(archive, "verdicts/run_id=nightly-a") == ["verdicts/run_id=nightly-a/rules-nightly.parquet",
                                                             "verdicts/run_id=nightly-a/rules-smoke.parquet"]


def test_verdicts_of_an_archive_from_before_rules_files_read_with_no_rules(archive: str) -> None:
    # The layout before one file per rules file.
    write_parquet(archive, "verdicts/run_id=nightly-a/verdicts.parquet", pa.table({
        "rule": ["r0"], "kind": ["max_drop"], "cache": [K2], "baseline_run_id": [None], "observed": [1.0],
        "threshold": [2.0], "passed": [True], "detail": ["old"]}))
    write_verdicts(archive, "nightly-a", [Verdict("new", "max_drop", K2, 0.0, 1.0, True, "")], "gates/smoke.yaml")
    with Store(archive) as store:
        assert store.query("SELECT rules, rule, detail FROM verdicts ORDER BY rule")[1] == [
            ("smoke", "new", ""), (None, "r0", "old")]


def test_the_canary_fails_closed_when_the_candidate_answered_fewer_requests_than_the_baseline(archive: str) -> None:
    remove(archive, "results/run_id=canary-b/workload=gsm8k/cache=fp16/shard-00001.parquet")
    with Store(archive) as store:
        verdicts = evaluate(store, "canary-b", rules({"kind": "no_regression_vs_baseline", "margin": 100}))
    assert outcome(verdicts) == {("r0", FP16): False, ("r0", K2): True, ("r0", K4): True}
    assert next(v.detail for v in verdicts if v.cache == FP16).startswith("incomplete in candidate: gsm8k (10 of 20 requests)")


def test_same_outputs_fails_each_cache_with_a_changed_request_and_names_them(store: Store) -> None:
    verdicts = evaluate(store, "canary-b", rules({"kind": "same_outputs_as_baseline"}))
    assert outcome(verdicts) == {("r0", FP16): True, ("r0", K2): False, ("r0", K4): True}
    k2 = next(v for v in verdicts if v.cache == K2)
    # 20 gsm8k + 10 LongBench + 9 NIAH requests; kivi-2 of canary-b answers g05 (an error in nightly-a) and scores
    # two LongBench requests differently.
    assert k2.observed == 3 and k2.detail.startswith("3 of 39 baseline requests differ: gsm8k/gsm8k/g05, ")
    assert "longbench/gov_report/gov_report-1" in k2.detail and "longbench/narrativeqa/narrativeqa-3" in k2.detail
    assert next(v for v in verdicts if v.cache == FP16).detail == "0 of 39 baseline requests differ"


def test_same_outputs_counts_a_request_missing_from_the_candidate_and_filters_by_workload(archive: str) -> None:
    remove(archive, "results/run_id=canary-b/workload=gsm8k/cache=fp16/shard-00001.parquet")
    with Store(archive) as store:
        gsm8k = evaluate(store, "canary-b", rules({"kind": "same_outputs_as_baseline", "workload": "gsm8k", "cache": FP16}))
        niah = evaluate(store, "canary-b", rules({"kind": "same_outputs_as_baseline", "workload": "niah"}))
        alone = evaluate(store, "nightly-a", rules({"kind": "same_outputs_as_baseline"}))
    assert [(v.cache, v.observed) for v in gsm8k] == [(FP16, 10.0)] and "gsm8k/gsm8k/g10 missing" in gsm8k[0].detail
    assert all(v.passed for v in niah) and len(niah) == 3
    assert not alone[0].passed and alone[0].detail.startswith("missing baseline")
