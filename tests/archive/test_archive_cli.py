"""kivi-eval's archive commands (gate, report, query, runs) on the synthetic archive: unknown runs and archives are
one-line errors that write nothing, bad SQL is one line, and none of them imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from archive_files import listing

from pipeline.cli import main

REPO = Path(__file__).resolve().parents[2]
NIGHTLY = str(REPO / "configs/gates/nightly.yaml")


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
    assert says in line and "views and macros: results, perf, runs, verdicts, generations, run_summary" in line
    assert "baseline_deltas(candidate_run, baseline_run)" in line


def test_runs_lists_every_run_newest_first_with_its_row_counts(shared_archive, capsys) -> None:
    assert main(["runs", "--archive", shared_archive]) == 0
    header, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()]
    assert header == ["run_id", "kind", "model", "status", "started_at", "finished_at", "results", "errors",
                      "perf_points", "verdicts", "generations", "generation_errors"]
    # canary-b was stamped when the archive was built; nightly-a started on 2025-06-01.
    assert [(r[0], r[1], r[3], r[6], r[7], r[8]) for r in rows] == [
        ("canary-b", "canary", "complete", "117", "0", "14"), ("nightly-a", "nightly", "complete", "117", "1", "21")]
    assert rows[1][4] == "2025-06-01 02:00:00+00:00"
    assert main(["runs", "--last", "1", "--archive", shared_archive]) == 0
    assert "canary-b" in capsys.readouterr().out.splitlines()[-1]


def test_the_archive_commands_import_neither_torch_nor_transformers_nor_ray(archive, tmp_path) -> None:
    commands = [["query", "SELECT count(*) FROM kivi_deltas"], ["runs"], ["gate", "nightly-a", "--rules", NIGHTLY],
                ["report", "nightly-a", "--out", str(tmp_path)]]
    code = (f"import sys; from pipeline.cli import main\n"
            f"codes = [main([*c, '--archive', {archive!r}]) for c in {commands!r}]\n"
            "print(codes, sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[0, 0, 1, 0] []"  # the nightly gate fails on this archive, by design
