"""kivi-eval's archive commands (gate, report, query, runs) on the synthetic archive: unknown runs and archives are
one-line errors that write nothing, bad SQL is one line, and none of them imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from archive_files import listing
from synthetic_archive import K2, K4

from pipeline.archive import ArchiveWriter
from pipeline.cli import main
from pipeline.store import Store

REPO = Path(__file__).resolve().parents[2]
NIGHTLY = str(REPO / "configs/gates/nightly.yaml")
SMOKE = str(REPO / "configs/gates/smoke.yaml")


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line the command wrote to stderr."""
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kivi-eval: error: ")
    return line


def test_gating_an_unknown_run_is_an_error_naming_the_closest_run_and_writes_no_verdicts(archive, capsys) -> None:
    assert main(["gate", "nightly-b", "--rules", NIGHTLY, "--archive", archive]) == 2
    line = error_line(capsys)
    assert "no run 'nightly-b'" in line and "(did you mean 'nightly-a'?)" in line and "newest runs: canary-b, nightly-a" in line
    assert listing(archive, "verdicts") == []


def test_reporting_an_unknown_run_exits_non_zero_and_writes_nothing(shared_archive, tmp_path, capsys) -> None:
    assert main(["report", "no-such-run", "--archive", shared_archive, "--out", str(tmp_path / "reports")]) == 2
    assert "no run 'no-such-run'" in error_line(capsys)
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_a_folder_that_holds_no_archive_is_an_error_naming_the_fix(root, capsys, folder) -> None:
    if "://" not in root:  # an object store has no empty folders: there both are a prefix that holds nothing
        (Path(root) / "empty").mkdir()
    for command in (["query", "SELECT count(*) FROM results"], ["runs"]):
        assert main([*command, "--archive", f"{root}/{folder}"]) == 2
        line = error_line(capsys)
        assert f"no archive at {root}/{folder}" in line and "pass --archive PATH or URI, or set KIVI_ARCHIVE" in line


def test_an_archive_uri_that_pyarrow_cannot_resolve_or_that_holds_credentials_is_one_error(capsys) -> None:
    assert main(["runs", "--archive", "nosuch://bucket/x"]) == 2
    assert "archive nosuch://bucket/x: Unrecognized filesystem type in URI" in error_line(capsys)
    assert main(["runs", "--archive", "s3://key:secret@bucket/x"]) == 2
    line = error_line(capsys)
    assert "credentials in the URI" in line and "AWS_ACCESS_KEY_ID" in line and "secret" not in line.split("would")[0]


@pytest.mark.parametrize("sql, says", [
    ("SELECT * FROM kivi_delta", 'Table with name kivi_delta does not exist! Did you mean "kivi_deltas"?'),
    ("SELECT delta FROM kivi_deltas", 'Referenced column "delta" not found'),
])
def test_a_bad_statement_is_one_error_line_listing_the_views(shared_archive, capsys, sql, says) -> None:
    assert main(["query", sql, "--archive", shared_archive]) == 2
    line = error_line(capsys)
    assert says in line and "views and macros: results, perf, runs, verdicts, generations, presets, run_summary" in line
    assert "baseline_deltas(candidate_run, baseline_run)" in line


def test_runs_lists_every_run_newest_first_with_its_row_counts(shared_archive, capsys) -> None:
    assert main(["runs", "--archive", shared_archive]) == 0
    header, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()]
    assert header == ["run_id", "kind", "label", "model", "status", "started_at", "finished_at", "results", "errors",
                      "perf_points", "verdicts", "gate_passed", "generations", "generation_errors"]
    # canary-b was stamped when the archive was built; nightly-a started on 2025-06-01. Neither was gated.
    assert [(r[0], r[1], r[2], r[4], r[7], r[8], r[9], r[11]) for r in rows] == [
        ("canary-b", "canary", "canary", "complete", "117", "0", "14", "NULL"),
        ("nightly-a", "nightly", "nightly", "complete", "117", "1", "21", "NULL")]
    assert rows[1][5] == "2025-06-01 02:00:00+00:00"
    assert main(["runs", "--last", "1", "--archive", shared_archive]) == 0
    assert "canary-b" in capsys.readouterr().out.splitlines()[-1]
    assert main(["runs", "-q", "--archive", shared_archive]) == 0
    assert capsys.readouterr().out.splitlines() == ["canary-b", "nightly-a"]  # for RUN=$(kivi-eval runs --last 1 -q)


def with_gate(archive: str, run_id: str, rules: str) -> None:
    """The run's manifest as if its config had named ``rules`` (gate:)."""
    writer = ArchiveWriter(archive, run_id)
    manifest = writer.read_run()
    writer.write_run({**manifest, "config_yaml": f"{manifest['config_yaml']}gate: {rules}\n"})


def test_gate_without_rules_evaluates_the_runs_own_rules_and_records_them(archive, capsys) -> None:
    with_gate(archive, "nightly-a", SMOKE)
    assert main(["gate", "nightly-a", "--archive", archive]) == 1
    out = capsys.readouterr().out
    assert f"gate smoke ({SMOKE}) on nightly-a: FAILED, 3 of 5 verdicts passed\n" in out and "not recorded" not in out
    assert listing(archive, "verdicts") == ["verdicts/run_id=nightly-a/rules-smoke.parquet"]


def test_other_rules_tried_on_a_run_are_printed_but_kept_only_with_record(archive, capsys) -> None:
    with_gate(archive, "nightly-a", SMOKE)
    assert main(["gate", "nightly-a", "--rules", NIGHTLY, "--archive", archive]) == 1
    assert "6 of 9 verdicts passed; not recorded: pass --record to keep these verdicts with the run" in capsys.readouterr().out
    assert listing(archive, "verdicts") == []  # the run's report and history are as they were
    with Store(archive) as store:
        assert store.records("SELECT gate_passed FROM run_summary WHERE run_id = 'nightly-a'") == [{"gate_passed": None}]
    assert main(["gate", "nightly-a", "--rules", NIGHTLY, "--record", "--archive", archive]) == 1
    assert listing(archive, "verdicts") == ["verdicts/run_id=nightly-a/rules-nightly.parquet"]
    with Store(archive) as store:
        assert store.records("SELECT gate_passed FROM run_summary WHERE run_id = 'nightly-a'") == [{"gate_passed": False}]


@pytest.mark.parametrize("rule, says", [
    ("{name: r, kind: max_drop, workload: gsm8k, cache: kivi-k2v2-g23-r128, margin: 3}",
     f"rule 'r': cache 'kivi-k2v2-g23-r128' is not run by run nightly-a (caches: {K2}, {K4}) (did you mean '{K2}'?)"),
    ("{name: r, kind: max_drop, workload: gsm8, margin: 3}",
     "rule 'r': workload 'gsm8' is not in run nightly-a's workloads (gsm8k, longbench, niah, fidelity, sharegpt) "
     "(did you mean 'gsm8k'?): correct the name or drop the rule"),
    ("{name: r, kind: max_drop, workload: longbench, task: qasper, margin: 3}",
     "rule 'r': task 'qasper' is not run by workload 'longbench' (tasks: narrativeqa, gov_report, trec)"),
])
def test_rules_tried_on_a_run_that_name_what_it_never_ran_are_bad_input_not_a_failed_gate(archive, tmp_path, capsys,
                                                                                          rule, says) -> None:
    rules = tmp_path / "typo.yaml"
    rules.write_text(f"rules:\n  - {rule}\n")
    assert main(["gate", "nightly-a", "--rules", str(rules), "--archive", archive]) == 2
    assert says in error_line(capsys)
    assert listing(archive, "verdicts") == []


def test_gating_a_run_whose_config_names_no_rules_asks_for_them(archive, capsys) -> None:
    assert main(["gate", "nightly-a", "--archive", archive]) == 2
    assert "run nightly-a's config names no gate rules file (gate:); pass --rules FILE" in error_line(capsys)


def test_each_verdict_prints_on_its_own_wrapped_lines_with_pass_or_fail_first(archive, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    main(["gate", "nightly-a", "--rules", NIGHTLY, "--archive", archive])
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines[2:])) <= 100
    assert [line.split(":")[0] for line in lines if line.startswith("  ") and not line.startswith("   ")][:3] == [
        f"  pass  gsm8k-drop ({K2})", f"  pass  gsm8k-drop-kivi4 ({K4})", f"  pass  longbench-avg ({K2})"]


def test_a_query_that_finds_nothing_for_a_preset_name_says_how_the_archive_spells_it(shared_archive, capsys) -> None:
    assert main(["query", "SELECT * FROM kivi_deltas WHERE cache = 'kivi-2'", "--archive", shared_archive]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2  # the header and its rule: no row
    assert err.startswith("kivi-eval: note: no rows, and the query names the preset 'kivi-2'")
    assert f"'kivi-2' is '{K2}'" in err and "JOIN presets USING (cache) WHERE preset = 'kivi-2'" in err
    sql = "SELECT DISTINCT cache FROM kivi_deltas JOIN presets USING (cache) WHERE preset = 'kivi-2'"
    assert main(["query", sql, "--archive", shared_archive]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].strip("| ") == K2 and err == ""


@pytest.mark.parametrize("command, says", [
    ("gate", "default: the rules file the run's config names"),
    ("gate", "--record"),
    ("report", "OUT/<run_id>/report.md (default: reports)"),
    ("runs", "default: $KIVI_ARCHIVE, else ./archive"),
])
def test_each_option_says_what_it_takes_and_its_default_in_help(capsys, command, says) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert says in " ".join(capsys.readouterr().out.split())


def test_the_archive_commands_import_neither_torch_nor_transformers_nor_ray(archive, tmp_path) -> None:
    commands = [["query", "SELECT count(*) FROM kivi_deltas"], ["runs"], ["gate", "nightly-a", "--rules", NIGHTLY],
                ["report", "nightly-a", "--out", str(tmp_path)]]
    code = (f"import sys; from pipeline.cli import main\n"
            f"codes = [main([*c, '--archive', {archive!r}]) for c in {commands!r}]\n"
            "print(codes, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[0, 0, 1, 0] []"  # the nightly gate fails on this archive, by design
