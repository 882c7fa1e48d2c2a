"""kivi-eval: run a config, gate a run, write its report, query the archive.

    kivi-eval run configs/smoke.yaml              # local Ray unless --address / RAY_ADDRESS (--no-ray: in process)
    kivi-eval generate --input prompts.jsonl --output gen --model smollm2-135m --cache fp16 --cache kivi-2
    kivi-eval runs [--last 10] [-q]               # the archive's runs, newest first (-q: their ids only)
    kivi-eval gate RUN_ID                         # the run's own rules again; --rules FILE tries others
    kivi-eval report RUN_ID
    kivi-eval query "SELECT * FROM kivi_delta_stats"
    kivi-eval history --model smollm2-135m --workload gsm8k [--cache kivi-2] [--last 10] [--label smoke]
    kivi-eval model-folder smollm2-135m           # a packaged model as a transformers folder (e.g. for lm-eval)

Each command imports what it needs when it runs: the archive commands (gate, report, query, runs, history) start
without torch, transformers or Ray, and `run` checks an evaluation config before it imports them (a generate
config: before any weights load).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import InputError
from pipeline.generation.cli import FLAGS, add_generate_arguments, summary_lines
from pipeline.names import GENERATE, RUN_KINDS

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from pipeline.gate import Verdict
    from pipeline.store import Store

DEFAULT_ARCHIVE = os.environ.get("KIVI_ARCHIVE", "archive")
RUN_FAILED = 3  # exit code of a run that stopped (0: every gate rule passed, 1: a rule failed, 2: bad input)
INTERRUPTED = 130  # a run stopped by Ctrl-C (the shell's code for SIGINT)
ARCHIVE_HELP = "archive root: a folder or a URI such as s3://bucket/prefix (default: $KIVI_ARCHIVE, else ./archive)"


def run_config(config_path: str, run_id: str | None = None, archive: str | None = None, address: str | None = None,
               kind: str | None = None, baseline_run_id: str | None = None, no_ray: bool = False) -> int:
    """Check a config, then run (or resume) it, gate it with its own rules and report it; returns the gate's exit code
    (0 without rules), or RUN_FAILED when the run stopped: it is still gated and reported with what it wrote. A
    config of the generate kind runs as ``kivi-eval generate --config`` does.

    The checks come in stages, each importing only what it needs (the config: neither torch nor scipy; its gate
    rules: scipy; the run: torch, transformers and Ray), so that a mistake is answered before the next one's imports.
    """
    from pipeline.config import config_kind, load_config

    if config_kind(config_path) == GENERATE:
        return generate_run(config_path, {"output": archive, "ray.address": address}, run_id, no_ray)
    config = load_config(config_path, archive=archive, kind=kind, baseline_run_id=baseline_run_id)
    if address:
        config = config.model_copy(update={"ray": config.ray.model_copy(update={"address": address})})
    return _check_rules_and_run(config, config_path, run_id, no_ray)


def _check_rules_and_run(config: RunConfig, config_path: str, run_id: str | None, no_ray: bool) -> int:
    from pipeline.gate import check_config_rules

    check_config_rules(config, config_path)
    return _run(config, Path(config_path).read_text(), run_id, no_ray)


def _run(config: RunConfig, config_yaml: str, run_id: str | None, no_ray: bool) -> int:
    from pipeline.report import actor_line
    from pipeline.runner import format_seconds, new_run_id, run

    run_id = run_id or new_run_id(config.label)

    def attempt() -> None:
        began = time.perf_counter()
        summary = run(config, config_yaml, run_id, in_process=no_ray)
        sweeps = f", {len(summary.sweeps)} sweeps ({', '.join(summary.sweeps)})" if summary.sweeps else ""
        print(f"\nrun {run_id} complete in {format_seconds(time.perf_counter() - began)}: "
              f"{len(summary.computed)} shard × cache files computed, {summary.reused} reused{sweeps}")
        for i, placement in enumerate(summary.placements):
            print(f"  actor {i}: {actor_line(placement)}")

    return conclude(run_id, config.archive, attempt, config.gate, config.reports, config.baseline_run_id,
                    summarize=lambda: _scores(run_id, config.archive))


def generate_command(args: argparse.Namespace) -> int:
    return generate_run(args.config, {field: getattr(args, field) for field in FLAGS}, args.run_id, args.no_ray)


def generate_run(config_path: str | None, flags: dict[str, Any], run_id: str | None, no_ray: bool) -> int:
    """Generate (or resume ``run_id``), print the summary, gate the run where the config names rules, report it;
    returns the exit code as ``kivi-eval run`` does."""
    from pipeline.generation.config import load_generate_config
    from pipeline.generation.runner import generate
    from pipeline.runner import new_run_id

    config = load_generate_config(config_path, **flags)
    run_id = run_id or new_run_id(GENERATE)

    def attempt() -> None:
        began = time.perf_counter()
        summary = generate(config, run_id, in_process=no_ray)
        for line in summary_lines(summary, config.output, time.perf_counter() - began):
            print(line)

    return conclude(run_id, config.output, attempt, config.gate, config.reports)


def conclude(run_id: str, archive: str, attempt: Callable[[], None], rules, reports,
             baseline_run_id: str | None = None, summarize: Callable[[], None] | None = None) -> int:
    """Run ``attempt`` (it prints its own summary), ``summarize`` what the run wrote, gate the run with its own
    ``rules`` (when given) and report it; returns the gate's exit code (0 without rules), or RUN_FAILED when the run
    stopped: it is still summarized, gated and reported with what it wrote, marked partial. Interrupted (Ctrl-C),
    it says how to resume and returns INTERRUPTED at once."""
    from pipeline.archive import ArchiveWriter
    from pipeline.errors import ConfigError
    from pipeline.runner import ResumeError, describe_failure, format_seconds

    began = time.perf_counter()
    resume = (f"its finished files are kept: the same command with --run-id {run_id} computes only what is "
              "missing")
    try:
        attempt()
    except (ResumeError, ConfigError):
        raise  # refused before anything ran: the run's manifest and files are as they were
    except KeyboardInterrupt:
        print(f"\nkivi-eval: run {run_id} interrupted after {format_seconds(time.perf_counter() - began)}; {resume}",
              file=sys.stderr)
        return INTERRUPTED
    except Exception as err:
        if ArchiveWriter(archive, run_id).read_run() is None:
            raise  # stopped before the run began: nothing to gate or report
        failed = True
        print(f"kivi-eval: run {run_id} failed after {format_seconds(time.perf_counter() - began)}: "
              f"{describe_failure(err)}; {resume}", file=sys.stderr)
    else:
        failed = False
    if summarize:
        summarize()
    code = gate(run_id, archive, rules, baseline_run_id, record=True) if rules else 0
    report(run_id, archive, str(reports))
    return RUN_FAILED if failed else code


def _scores(run_id: str, archive: str) -> None:
    from pipeline.store import format_table

    columns = ["workload", "cache", "fp16_score", "kivi_score", "delta_points", "ci_low", "ci_high", "n_pairs"]
    with _archive(archive, run_id) as store:
        _, rows = store.query(f"SELECT {', '.join(columns)} FROM kivi_delta_stats WHERE run_id = $1 ORDER BY ALL",
                              [run_id])
    if rows:
        print("\nscores (fractions) and KIVI − fp16 in points, with its paired 95% interval:")
        print(format_table(columns, rows))


def gate(run_id: str, archive: str, rules_path: str | os.PathLike[str] | None = None,
         baseline_run_id: str | None = None, record: bool = False) -> int:
    """Gate ``run_id`` with ``rules_path`` (default: the rules its config names) and print the verdicts. They are
    kept in the archive, replacing that rules file's earlier ones, when they are the run's own rules or ``record``
    asks: rules tried on a run leave its report and history as they were."""
    from pipeline.gate import check_rules_fit_run, evaluate, exit_code, load_gate, own_rules, write_verdicts

    with _archive(archive, run_id) as store:  # an unknown baseline fails closed in the rules that need one
        own = own_rules(store, run_id)
        rules_path = Path(rules_path) if rules_path is not None else own
        if rules_path is None:
            raise InputError(f"run {run_id}'s config names no gate rules file (gate:); pass --rules FILE")
        if own is not None and rules_path == own and not own.is_file():
            raise InputError(f"run {run_id}'s config names gate: {own}, no file from {Path.cwd()}; pass --rules FILE")
        rules = load_gate(rules_path)
        check_rules_fit_run(store, run_id, rules, rules_path)
        verdicts = evaluate(store, run_id, rules, baseline_run_id)
    record = record or (own is not None and own.resolve() == rules_path.resolve())
    if record:
        write_verdicts(archive, run_id, verdicts, rules_path)
    code = exit_code(verdicts)
    passed = sum(v.passed for v in verdicts)
    kept = "" if record else "; not recorded: pass --record to keep these verdicts with the run"
    print(f"\ngate {rules_path.stem} ({rules_path}) on {run_id}: {'PASSED' if code == 0 else 'FAILED'}, "
          f"{passed} of {len(verdicts)} verdicts passed{kept}")
    print(verdict_lines(verdicts))
    return code


def verdict_lines(verdicts: Sequence[Verdict]) -> str:
    """Each verdict as "pass|FAIL rule (cache): detail", wrapped to the terminal."""
    width = min(shutil.get_terminal_size((110, 24)).columns, 120)
    return "\n".join(textwrap.fill(v.detail, width, initial_indent=f"  {'pass' if v.passed else 'FAIL'}  {v.rule}"
                                   + (f" ({v.cache})" if v.cache else "") + ": ", subsequent_indent=" " * 8)
                     for v in verdicts)


def report(run_id: str, archive: str, out: str) -> Path:
    from pipeline.report import write_report

    with _archive(archive, run_id) as store:
        path = write_report(store, run_id, Path(out) / run_id)
    print(f"\nreport: {path}")
    return path


def query(sql: str, archive: str) -> None:
    from pipeline.store import format_table, preset_hint

    with _archive(archive) as store:
        columns, rows = store.query(sql)
    print(format_table(columns, rows))
    if not rows and (hint := preset_hint(sql)):
        print(f"kivi-eval: note: {hint}", file=sys.stderr)


def runs(archive: str, last: int | None = None, quiet: bool = False) -> None:
    from pipeline.store import NEWEST_FIRST, format_table

    with _archive(archive) as store:
        columns, rows = store.query(f"SELECT * FROM run_summary {NEWEST_FIRST} LIMIT $1", [last])
    print("\n".join(row[0] for row in rows) if quiet else format_table(columns, rows))


def history(model: str, workload: str, archive: str, cache: str | None = None, last: int | None = None,
            kind: str | None = None, label: str | None = None) -> None:
    from pipeline.history import COLUMNS, delta_history
    from pipeline.store import format_table

    with _archive(archive) as store:
        rows = delta_history(store, model, workload, cache, last, kind, label)
    print(format_table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows]))


@contextmanager
def _archive(root: str, run_id: str | None = None) -> Iterator[Store]:
    """The store over ``root``, which must hold runs, and ``run_id`` among them when one is given."""
    from pipeline.store import Store

    with Store(root) as store:
        if not store.run_ids():
            raise InputError(f"no archive at {root} ({store.root}): no run in its runs/, results/ or perf/ "
                             "folders; pass --archive PATH or URI, or set KIVI_ARCHIVE")
        if run_id is not None:
            store.require_run(run_id)
        yield store


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kivi-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="check a config, run or resume it, then gate it with its rules and report it")
    p.add_argument("config", help="run config YAML; its relative paths are read from the working directory")
    p.add_argument("--run-id", help="resume this run (only missing shards are computed)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--archive", help="archive root: a folder or a URI, s3://bucket/prefix … (default: the config's archive)")
    p.add_argument("--no-ray", action="store_true", help="one worker in this process, without Ray (same worker code)")
    p = sub.add_parser("generate", help="generate a completion for every input row under each cache, on Ray; resumable")
    add_generate_arguments(p)
    p = sub.add_parser("gate", help="gate a run: its own rules again, or others tried on it; exit 0 only if all pass")
    p.add_argument("run_id")
    p.add_argument("--rules", help="gate rules YAML, e.g. configs/gates/nightly.yaml (default: the rules file the run's "
                                   "config names, its gate:)")
    p.add_argument("--record", action="store_true", help="keep the verdicts of --rules with the run (its own rules' "
                   "always are): its report shows them under their own heading and history counts them")
    p.add_argument("--baseline", help="baseline run for canary rules (default: the run manifest's)")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE, help=ARCHIVE_HELP)
    p = sub.add_parser("report", help="write reports/<run_id>/report.md with plots")
    p.add_argument("run_id")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE, help=ARCHIVE_HELP)
    p.add_argument("--out", default="reports", help="the report goes to OUT/<run_id>/report.md (default: reports)")
    p = sub.add_parser("query", help="read-only SQL over the archive (views: results, perf, runs, verdicts, kivi_deltas …)")
    p.add_argument("sql")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE, help=ARCHIVE_HELP)
    p = sub.add_parser("runs", help="the archive's runs, newest first: kind, label, model, status, times, row counts, gate")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE, help=ARCHIVE_HELP)
    p.add_argument("--last", type=_positive, help="only the newest N runs")
    p.add_argument("-q", "--quiet", action="store_true", help="only the run ids, one a line (RUN=$(kivi-eval runs --last 1 -q))")
    p = sub.add_parser("history", help="a model's KIVI − fp16 deltas on one workload across runs, oldest first, "
                                       "with the 95%% interval and whether each run's gate passed")
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--cache", help="one KIVI cache, by preset (kivi-2) or archive name (default: every one)")
    p.add_argument("--last", type=_positive, help="only the newest N runs")
    p.add_argument("--kind", help=f"only runs of this kind ({', '.join(RUN_KINDS)})")
    p.add_argument("--label", help="only runs of this label (a config's label; by default its kind)")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE, help=ARCHIVE_HELP)
    p = sub.add_parser("model-folder", help="print a packaged model's transformers folder (converted on first use)")
    p.add_argument("name")
    p.add_argument("--from-gguf", type=Path, help="convert from this copy of the packaged GGUF (sha256 checked), "
                                                  "where the packages cannot be installed")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return run_config(args.config, args.run_id, args.archive, args.address, no_ray=args.no_ray)
        if args.command == "generate":
            return generate_command(args)
        if args.command == "gate":
            return gate(args.run_id, args.archive, args.rules, args.baseline, args.record)
        if args.command == "report":
            report(args.run_id, args.archive, args.out)
        elif args.command == "runs":
            runs(args.archive, args.last, args.quiet)
        elif args.command == "history":
            history(args.model, args.workload, args.archive, args.cache, args.last, args.kind, args.label)
        elif args.command == "model-folder":
            from pipeline.models import converted_folder

            print(converted_folder(args.name, args.from_gguf))
        else:
            query(args.sql, args.archive)
        return 0
    except InputError as err:
        print(f"kivi-eval: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
