"""A model's KIVI − fp16 deltas across the archive's runs, oldest first: the trend behind each nightly verdict.

One row per run and KIVI cache of a workload, read from the store's kivi_deltas (the scores) and
kivi_delta_stats (the paired delta and its 95% interval), with whether the run's gate passed its rules on
that workload and cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kivi.config import did_you_mean
from pipeline.errors import InputError
from pipeline.names import FP16
from pipeline.store import NEWEST_FIRST, Store

COLUMNS = ("run_id", "kind", "started_at", "cache", "fp16", "kivi", "delta_points", "ci_low", "ci_high", "n_pairs",
           "p_value", "gate_passed")

# The newest $5 runs (all when null) of model $1 on workload $2, cache $3 and run kind $4 when given.
_HISTORY = f"""
    WITH d AS (SELECT d.*, r.kind, r.started_at FROM kivi_deltas d LEFT JOIN runs r USING (run_id)
               WHERE d.model = $1 AND d.workload = $2 AND ($3::VARCHAR IS NULL OR d.cache = $3)
                 AND ($4::VARCHAR IS NULL OR r.kind = $4)),
         newest AS (SELECT DISTINCT run_id, started_at FROM d {NEWEST_FIRST} LIMIT $5)
    SELECT d.run_id, d.kind, d.started_at, d.cache, 100 * d.fp16_score AS fp16, 100 * d.kivi_score AS kivi,
           s.delta_points, s.ci_low, s.ci_high, s.n_pairs, s.p_value
    FROM d JOIN newest USING (run_id) JOIN kivi_delta_stats s USING (run_id, workload, cache)
    ORDER BY d.started_at NULLS FIRST, d.run_id, d.cache"""


class NoHistoryError(InputError):
    """The archive holds no KIVI result of that model, workload, cache or kind; the message names the closest."""


def delta_history(store: Store, model: str, workload: str, cache: str | None = None, last: int | None = None,
                  kind: str | None = None) -> list[dict[str, Any]]:
    """Rows of COLUMNS, oldest run first (runs without a manifest row first); ``last``: only the newest N runs.
    Scores and deltas are in points; gate_passed is null where no verdict of the run covers the workload and cache."""
    _require_known(store, model=model, workload=workload, cache=cache, kind=kind)
    rows = store.records(_HISTORY, [model, workload, cache, kind, last])
    gated = gated_metrics(store, sorted({r["run_id"] for r in rows}))
    return [r | {"gate_passed": gated.get((r["run_id"], workload, r["cache"]))} for r in rows]


def gated_metrics(store: Store, run_ids: Sequence[str]) -> dict[tuple[str, str, str], bool]:
    """{(run_id, workload, cache): whether every verdict of a rule on that workload and cache passed}; rules over
    every workload (the baseline rules) name none."""
    rows = store.records(
        "SELECT run_id, workload, cache, bool_and(passed) AS passed FROM verdicts "
        "WHERE list_contains($1, run_id) AND workload IS NOT NULL AND cache IS NOT NULL GROUP BY ALL", [list(run_ids)])
    return {(r["run_id"], r["workload"], r["cache"]): r["passed"] for r in rows}


def _require_known(store: Store, **names: str | None) -> None:
    """Raise NoHistoryError for the first given name (model, workload, cache, kind) that no KIVI result has,
    among the results that match the names before it."""
    # From results, not kivi_deltas: one scan instead of its joins, and the same names.
    _, rows = store.query("SELECT DISTINCT d.model, d.workload, d.cache, r.kind FROM results d "
                          f"LEFT JOIN runs r USING (run_id) WHERE d.cache <> '{FP16}'")
    scope: list[str] = []
    for i, (what, value) in enumerate(names.items()):
        if value is None:
            continue
        known = sorted({row[i] for row in rows if row[i] is not None})
        if value not in known:
            of = f" of {', '.join(scope)}" if scope else ""
            raise NoHistoryError(f"no KIVI result{of} with {what} {value!r} in the archive {store.root}"
                                 f"{did_you_mean(value, known, n=3)}; {what}s there: {', '.join(known) or 'none'}")
        rows = [row for row in rows if row[i] == value]
        scope.append(f"{what} {value}")
