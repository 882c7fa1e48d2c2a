"""A model's KIVI − fp16 deltas across the archive's runs, oldest first: the trend behind each nightly verdict.

One row per run and KIVI cache of a workload, read from the store's kivi_delta_stats (the two scores as fractions,
the paired delta in points and its 95% interval: the store's units), with whether the run's gate passed its rules
on that workload and cache. A cache may be named by its preset (kivi-2) or its archive name (kivi-k2v2-g32-r128).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kivi.config import cache_name, cache_presets, did_you_mean
from pipeline.errors import InputError
from pipeline.names import FP16
from pipeline.store import NEWEST_FIRST, Store

COLUMNS = ("run_id", "kind", "label", "started_at", "cache", "fp16_score", "kivi_score", "delta_points", "ci_low",
           "ci_high", "n_pairs", "p_value", "gate_passed")

# The newest $5 runs (all when null) of model $1 on workload $2, with cache $3, run kind $4 and label $6 when given.
_HISTORY = f"""
    WITH d AS (SELECT s.*, r.kind, coalesce(r.label, r.kind) AS label, r.started_at
               FROM kivi_delta_stats s LEFT JOIN runs r USING (run_id)
               WHERE s.model = $1 AND s.workload = $2 AND ($3::VARCHAR IS NULL OR s.cache = $3)
                 AND ($4::VARCHAR IS NULL OR r.kind = $4) AND ($6::VARCHAR IS NULL OR coalesce(r.label, r.kind) = $6)),
         newest AS (SELECT DISTINCT run_id, started_at FROM d {NEWEST_FIRST} LIMIT $5)
    SELECT d.run_id, d.kind, d.label, d.started_at, d.cache, d.fp16_score, d.kivi_score, d.delta_points, d.ci_low,
           d.ci_high, d.n_pairs, d.p_value
    FROM d JOIN newest USING (run_id)
    ORDER BY d.started_at NULLS FIRST, d.run_id, d.cache"""


class NoHistoryError(InputError):
    """The archive holds no KIVI result of that model, workload, cache, kind or label; the message names the closest."""


def delta_history(store: Store, model: str, workload: str, cache: str | None = None, last: int | None = None,
                  kind: str | None = None, label: str | None = None) -> list[dict[str, Any]]:
    """Rows of COLUMNS, oldest run first (runs without a manifest row first); ``last``: only the newest N runs.
    Scores are fractions and deltas points; gate_passed is null where no verdict of the run covers the workload and
    cache."""
    cache = None if cache is None else cache_name(cache)
    _require_known(store, model=model, workload=workload, cache=cache, kind=kind, label=label)
    rows = store.records(_HISTORY, [model, workload, cache, kind, last, label])
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
    """Raise NoHistoryError for the first given name (model, workload, cache, kind, label) that no KIVI result has,
    among the results that match the names before it."""
    # From results, not kivi_deltas: one scan instead of its joins, and the same names.
    _, rows = store.query("SELECT DISTINCT d.model, d.workload, d.cache, r.kind, coalesce(r.label, r.kind) FROM results d "
                          f"LEFT JOIN runs r USING (run_id) WHERE d.cache <> '{FP16}'")
    scope: list[str] = []
    for i, (what, value) in enumerate(names.items()):
        if value is None:
            continue
        known = sorted({row[i] for row in rows if row[i] is not None})
        if value not in known:
            of = f" of {', '.join(scope)}" if scope else ""
            # A cache is also named by its preset: both are offered, as a user may have typed either.
            presets = {c: p for c, p in cache_presets().items() if c in known} if what == "cache" else {}
            shown = [f"{name} ({presets[name]})" if name in presets else name for name in known]
            raise NoHistoryError(f"no KIVI result{of} with {what} {value!r} in the archive {store.root}"
                                 f"{did_you_mean(value, [*known, *presets.values()], n=3)}; {what}s there: "
                                 f"{', '.join(shown) or 'none'}")
        rows = [row for row in rows if row[i] == value]
        scope.append(f"{what} {value}")
