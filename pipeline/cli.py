"""kivi-eval: run a config, gate a run, write its report, query the archive.

    kivi-eval run configs/smoke.yaml              # local Ray unless --address / RAY_ADDRESS (--no-ray: in process)
    kivi-eval generate --input prompts.jsonl --output gen --model smollm2-135m --cache fp16 --cache kivi-2
    kivi-eval gate RUN_ID --rules configs/gates/nightly.yaml
    kivi-eval report RUN_ID
    kivi-eval query "SELECT * FROM kivi_deltas"
    kivi-eval runs [--last 10]                    # the archive's runs, newest first
    kivi-eval history --model smollm2-135m --workload gsm8k [--cache C] [--last 10] [--kind nightly]
    kivi-eval model-folder smollm2-135m           # a packaged model as a transformers folder (e.g. for lm-eval)

Each command imports what it needs when it runs: the archive commands (gate, report, query, runs, history) start
without torch, transformers or Ray.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import InputError
from pipeline.generation.cli import add_generate_arguments, generate_command
from pipeline.names import RUN_KINDS

if TYPE_CHECKING:
    from pipeline.store import Store

DEFAULT_ARCHIVE = os.environ.get("KIVI_ARCHIVE", "archive")
RUN_FAILED = 3  # exit code of a run that stopped (0: every gate rule passed, 1: a rule failed, 2: bad input)


def run_config(config_path: str, run_id: str | None = None, archive: str | None = None, address: str | None = None,
               kind: str | None = None, baseline_run_id: str | None = None, no_ray: bool = False) -> int:
    """Run (or resume) a config, then gate and report it (``conclude``); a config of the generate kind runs as
    ``kivi-eval generate --config`` does."""
    from pipeline.config import load_config
    from pipeline.gate import check_config_rules
    from pipeline.generation.config import is_generate_config
    from pipeline.runner import new_run_id, run

    if is_generate_config(config_path):
        from pipeline.generation.cli import generate_run

        return generate_run(config_path, {"output": archive, "ray.address": address}, run_id, no_ray)
    overrides = dict(archive=archive, kind=kind, baseline_run_id=baseline_run_id)
    config = load_config(config_path, **overrides)
    check_config_rules(config, config_path)
    if address:
        config = config.model_copy(update={"ray": config.ray.model_copy(update={"address": address})})
    run_id = run_id or new_run_id(config.kind)

    def attempt() -> None:
        began = time.perf_counter()
        summary = run(config, Path(config_path).read_text(), run_id, in_process=no_ray)
        print(f"run {run_id}: computed {len(summary.computed)} shard×cache, reused {summary.reused}, "
              f"sweeps {summary.sweeps} in {time.perf_counter() - began:.1f} s")
        for placement in summary.placements:
            print(f"  actor {placement}")

    return conclude(run_id, config.archive, attempt, config.gate, config.reports, config.baseline_run_id)


def conclude(run_id: str, archive: str, attempt: Callable[[], None], rules, reports,
             baseline_run_id: str | None = None) -> int:
    """Run ``attempt`` (it prints its own summary), then gate the run with ``rules`` (when given) and report it;
    returns the gate's exit code (0 without rules), or RUN_FAILED when the run stopped: it is still gated and
    reported with what it wrote, marked partial."""
    from pipeline.archive import ArchiveWriter
    from pipeline.errors import ConfigError
    from pipeline.runner import ResumeError, describe_failure

    began = time.perf_counter()
    try:
        attempt()
    except (ResumeError, ConfigError):
        raise  # refused before anything ran: the run's manifest and files are as they were
    except Exception as err:
        if ArchiveWriter(archive, run_id).read_run() is None:
            raise  # stopped before the run began: nothing to gate or report
        failed = True
        print(f"kivi-eval: run {run_id} failed after {time.perf_counter() - began:.1f} s: {describe_failure(err)}",
              file=sys.stderr)
    else:
        failed = False
    code = gate(run_id, rules, archive, baseline_run_id) if rules else 0
    report(run_id, archive, str(reports))
    return RUN_FAILED if failed else code


def gate(run_id: str, rules_path, archive: str, baseline_run_id: str | None = None) -> int:
    from pipeline.gate import evaluate, exit_code, load_gate, write_verdicts
    from pipeline.store import format_table

    rules = load_gate(rules_path)
    with _archive(archive, run_id) as store:  # an unknown baseline fails closed in the rules that need one
        verdicts = evaluate(store, run_id, rules, baseline_run_id)
    write_verdicts(archive, run_id, verdicts, rules_path)
    columns = ["rule", "cache", "observed", "threshold", "passed", "detail"]
    print(format_table(columns, [[getattr(v, c) for c in columns] for v in verdicts]))
    code = exit_code(verdicts)
    print(f"gate {'PASSED' if code == 0 else 'FAILED'} for {run_id} ({rules_path})")
    return code


def report(run_id: str, archive: str, out: str) -> Path:
    from pipeline.report import write_report

    with _archive(archive, run_id) as store:
        path = write_report(store, run_id, Path(out) / run_id)
    print(f"report: {path}")
    return path


def query(sql: str, archive: str) -> None:
    from pipeline.store import format_table

    with _archive(archive) as store:
        print(format_table(*store.query(sql)))


def runs(archive: str, last: int | None = None) -> None:
    from pipeline.store import NEWEST_FIRST, format_table

    with _archive(archive) as store:
        print(format_table(*store.query(f"SELECT * FROM run_summary {NEWEST_FIRST} LIMIT $1", [last])))


def history(model: str, workload: str, archive: str, cache: str | None = None, last: int | None = None,
            kind: str | None = None) -> None:
    from pipeline.history import COLUMNS, delta_history
    from pipeline.store import format_table

    with _archive(archive) as store:
        rows = delta_history(store, model, workload, cache, last, kind)
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
    p = sub.add_parser("run", help="run or resume a config, then gate and report it")
    p.add_argument("config")
    p.add_argument("--run-id", help="resume this run (only missing shards are computed)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--archive", help="archive root: a folder or a URI, s3://bucket/prefix … (default: the config's)")
    p.add_argument("--no-ray", action="store_true", help="one worker in this process, without Ray (same worker code)")
    p = sub.add_parser("generate", help="generate a completion for every input row under each cache, on Ray; resumable")
    add_generate_arguments(p)
    p = sub.add_parser("gate", help="evaluate gate rules for a run; exit 0 only if all pass")
    p.add_argument("run_id")
    p.add_argument("--rules", required=True)
    p.add_argument("--baseline", help="baseline run for canary rules (default: the run manifest's)")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE)
    p = sub.add_parser("report", help="write reports/<run_id>/report.md with plots")
    p.add_argument("run_id")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE)
    p.add_argument("--out", default="reports")
    p = sub.add_parser("query", help="read-only SQL over the archive (views: results, perf, runs, verdicts, kivi_deltas …)")
    p.add_argument("sql")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE)
    p = sub.add_parser("runs", help="the archive's runs, newest first: kind, model, status, times, row counts")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE)
    p.add_argument("--last", type=_positive, help="only the newest N runs")
    p = sub.add_parser("history", help="a model's KIVI − fp16 deltas on one workload across runs, oldest first, "
                                       "with the 95%% interval and whether each run's gate passed")
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--cache", help="one KIVI cache (default: every one)")
    p.add_argument("--last", type=_positive, help="only the newest N runs")
    p.add_argument("--kind", help=f"only runs of this kind ({', '.join(RUN_KINDS)})")
    p.add_argument("--archive", default=DEFAULT_ARCHIVE)
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
            return gate(args.run_id, args.rules, args.archive, args.baseline)
        if args.command == "report":
            report(args.run_id, args.archive, args.out)
        elif args.command == "runs":
            runs(args.archive, args.last)
        elif args.command == "history":
            history(args.model, args.workload, args.archive, args.cache, args.last, args.kind)
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
