"""Regression gate: rules from YAML, evaluated over the store into verdicts and an exit code.

Every rule yields one verdict per cache it covers. A metric the rule needs but the archive lacks (a
workload not run, a cache without rows, a partial run, no baseline) gives a failing verdict whose detail
starts with "missing" or "incomplete": the gate fails closed. Drops are in points (see pipeline.store).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kivi.config import did_you_mean
from pipeline.archive import FP16, ArchiveWriter
from pipeline.errors import InputError, read_yaml

if TYPE_CHECKING:  # DuckDB is the driver's: Ray actors import the config (and these rules) without it
    from pipeline.store import Store

# Scores are averages of floats: 0.70 - 0.68 is 2.0000000000000018 points, which must pass "points: 2".
_EPS = 1e-9
_SHOWN = 5  # failing cells or metrics listed in a detail before "…"


class GateConfigError(InputError):
    """Gate rules that do not validate; the message names the rule, the field and the fix."""


@dataclass(frozen=True)
class Verdict:
    rule: str
    kind: str
    cache: str | None
    observed: float | None
    threshold: float | None
    passed: bool
    detail: str
    baseline_run_id: str | None = None


@dataclass(frozen=True)
class _Context:
    store: Store
    run_id: str
    baseline_run_id: str | None

    def kivi_caches(self) -> list[str]:
        """Every non-fp16 cache the run produced results or perf rows for."""
        _, rows = self.store.query(
            "SELECT cache FROM results WHERE run_id = $1 UNION SELECT cache FROM perf WHERE run_id = $1", [self.run_id]
        )
        return sorted(c for (c,) in rows if c != FP16)


RULE_KINDS: dict[str, type[GateRule]] = {}


def _register(cls: type[GateRule]) -> type[GateRule]:
    RULE_KINDS[get_args(cls.model_fields["kind"].annotation)[0]] = cls
    return cls


class GateRule(BaseModel):
    """Fields every rule has; each kind adds its limits and implements `check`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, description="unique name, shown in verdicts")
    kind: str  # narrowed to a Literal by each rule class: the discriminator

    def _verdict(self, cache: str | None, observed: float | None, threshold: float | None, passed: bool, detail: str,
                 baseline_run_id: str | None = None) -> Verdict:
        return Verdict(self.name, self.kind, cache, observed, threshold, passed, detail, baseline_run_id)

    def _no_kivi_cache(self, ctx: _Context, threshold: float) -> Verdict:
        return self._verdict(None, None, threshold, False, f"missing: run {ctx.run_id} has no KIVI cache")

    def _no_baseline(self, ctx: _Context, threshold: float) -> Verdict:
        return self._verdict(None, None, threshold, False,
                             f"missing baseline: pass baseline_run_id or set runs.baseline_run_id of {ctx.run_id}")

    def check(self, ctx: _Context) -> list[Verdict]:
        raise NotImplementedError


@_register
class MaxDrop(GateRule):
    """KIVI may score at most `points` below fp16 of the same run (workload average, or one task)."""

    kind: Literal["max_drop"]
    workload: str
    task: str | None = Field(None, description="one task instead of the workload score")
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    points: float = Field(ge=0)

    def check(self, ctx: _Context) -> list[Verdict]:
        what = f"{self.workload}/{self.task}" if self.task else self.workload
        view, where, params = "kivi_deltas", "", [ctx.run_id, self.workload]
        if self.task:
            view, where, params = "kivi_task_deltas", "AND task = $3", [*params, self.task]
        sql = f"SELECT * FROM {view} WHERE run_id = $1 AND workload = $2 {where}"
        rows = {r["cache"]: r for r in ctx.store.records(sql, params)}
        verdicts = []
        for cache in [self.cache] if self.cache else ctx.kivi_caches():
            row = rows.get(cache)
            if row is None:
                verdicts.append(self._verdict(cache, None, self.points, False, f"missing {what} scores for {cache} or fp16"))
                continue
            drop = 0.0 - row["delta_points"]  # not -x: a zero delta must not print as -0.00
            if row["n_pairs"] < max(row["n_fp16"], row["n_cache"]):
                detail = f"incomplete {what}: {row['n_pairs']} paired requests of {row['n_fp16']} fp16 / {row['n_cache']} {cache}"
                verdicts.append(self._verdict(cache, drop, self.points, False, detail))
                continue
            detail = (f"{what}: fp16 {100 * row['fp16_score']:.2f} vs {100 * row['kivi_score']:.2f} "
                      f"({row['delta_points']:+.2f} points, n={row['n_pairs']})")
            verdicts.append(self._verdict(cache, drop, self.points, drop <= self.points + _EPS, detail))
        return verdicts or [self._no_kivi_cache(ctx, self.points)]


@_register
class CellsEqual(GateRule):
    """Every NIAH cell (task, context length, depth) scores as fp16 does, within `tolerance_points`."""

    kind: Literal["cells_equal"]
    workload: str = "niah"
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    tolerance_points: float = Field(0.0, ge=0)

    def check(self, ctx: _Context) -> list[Verdict]:
        cells: dict[str, dict[tuple, float]] = {}
        for r in ctx.store.records("SELECT * FROM niah_cells WHERE run_id = $1 AND workload = $2", [ctx.run_id, self.workload]):
            cells.setdefault(r["cache"], {})[(r["task"], r["context_length"], r["depth"])] = r["score"]
        reference = cells.get(FP16, {})
        verdicts = []
        for cache in [self.cache] if self.cache else ctx.kivi_caches():
            mine = cells.get(cache, {})
            if not reference or not mine:
                side = "fp16" if not reference else cache
                verdicts.append(self._verdict(cache, None, 0.0, False, f"missing {self.workload} cells for {side}"))
                continue
            unmatched = sorted(reference.keys() ^ mine.keys())
            differing = sorted(k for k in reference.keys() & mine.keys()
                               if 100 * abs(mine[k] - reference[k]) > self.tolerance_points + _EPS)
            notes = [f"{t} L={n} depth={d:g}: missing on one side" for t, n, d in unmatched]
            notes += [f"{t} L={n} depth={d:g}: fp16 {reference[(t, n, d)]:.2f} vs {mine[(t, n, d)]:.2f}" for t, n, d in differing]
            bad = len(unmatched) + len(differing)
            detail = f"{bad} of {len(reference.keys() | mine.keys())} cells differ"
            if notes:
                detail += ": " + "; ".join(notes[:_SHOWN]) + ("; …" if len(notes) > _SHOWN else "")
            verdicts.append(self._verdict(cache, float(bad), 0.0, bad == 0, detail))
        return verdicts or [self._no_kivi_cache(ctx, 0.0)]


@_register
class MinThroughputRatio(GateRule):
    """A KIVI cache's best tokens/s (any batch without OOM) is at least `ratio` × fp16's best."""

    kind: Literal["min_throughput_ratio"]
    workload: str = "sharegpt"
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    ratio: float = Field(gt=0)

    def check(self, ctx: _Context) -> list[Verdict]:
        rows = {r["cache"]: r for r in ctx.store.records(
            "SELECT * FROM throughput WHERE run_id = $1 AND workload = $2", [ctx.run_id, self.workload])}
        fp16 = rows.get(FP16)
        verdicts = []
        for cache in [self.cache] if self.cache else ctx.kivi_caches():
            row = rows.get(cache)
            if row is None or row["throughput_ratio"] is None:
                side = cache if fp16 and fp16["max_tokens_per_s"] is not None else "fp16"
                verdicts.append(self._verdict(cache, None, self.ratio, False, f"missing {self.workload} throughput for {side}"))
                continue
            ratio = row["throughput_ratio"]
            detail = (f"{row['max_tokens_per_s']:.1f} tokens/s (batch ≤ {row['max_batch']}) vs fp16 "
                      f"{fp16['max_tokens_per_s']:.1f} (batch ≤ {fp16['max_batch']}): {ratio:.2f}×")
            verdicts.append(self._verdict(cache, ratio, self.ratio, ratio >= self.ratio - _EPS, detail))
        return verdicts or [self._no_kivi_cache(ctx, self.ratio)]


@_register
class NoRegressionVsBaseline(GateRule):
    """No workload or task score of any cache falls more than `tolerance_points` below the baseline run."""

    kind: Literal["no_regression_vs_baseline"]
    tolerance_points: float = Field(ge=0)
    workload: str | None = Field(None, description="omitted: every workload of the baseline")
    cache: str | None = Field(None, description="omitted: every cache of the baseline, fp16 included")

    def check(self, ctx: _Context) -> list[Verdict]:
        baseline = ctx.baseline_run_id or _manifest_baseline(ctx)
        if baseline is None:
            return [self._no_baseline(ctx, self.tolerance_points)]
        metrics = ctx.store.records("SELECT *, NULL AS task FROM baseline_deltas($1, $2)", [ctx.run_id, baseline])
        metrics += ctx.store.records("SELECT * FROM baseline_task_deltas($1, $2)", [ctx.run_id, baseline])
        metrics = [m for m in metrics if self.workload in (None, m["workload"]) and self.cache in (None, m["cache"])]
        if not metrics:
            return [self._verdict(self.cache, None, self.tolerance_points, False,
                                  f"missing: baseline run {baseline} has no scores to compare", baseline)]
        by_cache: dict[str, list[dict[str, Any]]] = {}
        for m in metrics:
            by_cache.setdefault(m["cache"], []).append(m)
        return [self._compare(cache, ms, baseline) for cache, ms in sorted(by_cache.items())]

    def _compare(self, cache: str, metrics: list[dict[str, Any]], baseline: str) -> Verdict:
        scored = [m for m in metrics if m["candidate_score"] is not None]
        missing = [_label(m) for m in metrics if m["candidate_score"] is None]
        # A candidate mean over fewer requests than the baseline's could hide a regression in the rest.
        short = [f"{_label(m)} ({m['candidate_n']} of {m['baseline_n']} requests)" for m in scored
                 if m["candidate_n"] < m["baseline_n"]]
        versions = [f"{_label(m)} v{m['candidate_version']}≠v{m['baseline_version']}" for m in scored
                    if m["candidate_version"] != m["baseline_version"]]
        drops = sorted((0.0 - m["delta_points"], _label(m)) for m in scored)
        worst = drops[-1][0] if drops else None
        if missing:
            detail, passed = f"missing in candidate: {', '.join(missing[:_SHOWN])}", False
        elif short:
            detail, passed = f"incomplete in candidate: {', '.join(short[:_SHOWN])}", False
        elif versions:
            detail, passed = f"workload versions differ: {', '.join(versions[:_SHOWN])}", False
        else:
            over = [f"{name} −{drop:.2f}" for drop, name in reversed(drops) if drop > self.tolerance_points + _EPS]
            passed = not over
            detail = f"worst {drops[-1][1]}: {-worst:+.2f} points over {len(drops)} metrics"
            if over:
                detail += f"; over tolerance: {', '.join(over[:_SHOWN])}"
        return self._verdict(cache, worst, self.tolerance_points, passed, detail, baseline)


@_register
class SameOutputsAsBaseline(GateRule):
    """Every baseline request has the same output in the candidate: prediction, score and error. For changes that
    must not move a token: more GPUs or actors, a Ray, driver or library upgrade, a bit-exact kernel rewrite."""

    kind: Literal["same_outputs_as_baseline"]
    workload: str | None = Field(None, description="omitted: every workload of the baseline")
    cache: str | None = Field(None, description="omitted: every cache of the baseline, fp16 included")

    def check(self, ctx: _Context) -> list[Verdict]:
        baseline = ctx.baseline_run_id or _manifest_baseline(ctx)
        if baseline is None:
            return [self._no_baseline(ctx, 0.0)]
        rows = ctx.store.records(
            """SELECT b.cache, b.workload || '/' || b.task || '/' || b.request_id AS request, c.request_id IS NULL AS missing,
                      c.prediction IS DISTINCT FROM b.prediction OR c.score IS DISTINCT FROM b.score
                      OR c.error IS DISTINCT FROM b.error AS differs
               FROM results b LEFT JOIN results c ON c.run_id = $1 AND c.workload = b.workload AND c.task = b.task
                    AND c.request_id = b.request_id AND c.cache = b.cache
               WHERE b.run_id = $2 AND ($3::VARCHAR IS NULL OR b.workload = $3) AND ($4::VARCHAR IS NULL OR b.cache = $4)
               ORDER BY ALL""",
            [ctx.run_id, baseline, self.workload, self.cache])
        if not rows:
            return [self._verdict(self.cache, None, 0.0, False, f"missing: baseline run {baseline} has no results to compare",
                                  baseline)]
        verdicts = []
        for cache in sorted({r["cache"] for r in rows}):
            mine = [r for r in rows if r["cache"] == cache]
            bad = [r["request"] + (" missing" if r["missing"] else "") for r in mine if r["differs"]]
            detail = f"{len(bad)} of {len(mine)} baseline requests differ"
            if bad:
                detail += ": " + ", ".join(bad[:_SHOWN]) + (", …" if len(bad) > _SHOWN else "")
            verdicts.append(self._verdict(cache, float(len(bad)), 0.0, not bad, detail, baseline))
        return verdicts


def _label(metric: Mapping[str, Any]) -> str:
    return f"{metric['workload']}/{metric['task']}" if metric["task"] else metric["workload"]


def _manifest_baseline(ctx: _Context) -> str | None:
    rows = ctx.store.records("SELECT baseline_run_id FROM runs WHERE run_id = $1", [ctx.run_id])
    return rows[0]["baseline_run_id"] if rows else None


Rule = Annotated[Union[tuple(RULE_KINDS.values())], Field(discriminator="kind")]  # type: ignore[valid-type]


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rules: list[Rule] = Field(min_length=1)

    @field_validator("rules")
    @classmethod
    def _unique_names(cls, rules: list[GateRule]) -> list[GateRule]:
        names = [r.name for r in rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"rule names must be unique; repeated: {duplicates}")
        return rules


def load_gate(path: str | os.PathLike[str]) -> GateConfig:
    """Read gate rules from a YAML file (``configs/gates/*.yaml``)."""
    return parse_gate(read_yaml(Path(path), "gate rules file", GateConfigError), source=str(path))


def parse_gate(data: Any, source: str = "gate rules") -> GateConfig:
    """Validate a ``{"rules": [...]}`` mapping; errors name the rule, the field and the valid choices."""
    if not isinstance(data, Mapping):
        raise GateConfigError(f"{source}: expected a mapping with a 'rules' list, got {type(data).__name__}")
    if not isinstance(data.get("rules"), list):
        raise GateConfigError(f"{source}: 'rules' must be a list of rules; found keys {sorted(map(str, data))}")
    valid = ", ".join(RULE_KINDS)
    for i, rule in enumerate(data["rules"]):
        if not isinstance(rule, Mapping):
            raise GateConfigError(f"{source}: rules[{i}] must be a mapping like {{name: …, kind: max_drop, …}}")
        kind = rule.get("kind")
        if kind not in RULE_KINDS:
            raise GateConfigError(f"{source}: rules[{i}].kind={kind!r} is not a rule kind{did_you_mean(kind, RULE_KINDS)}; "
                                  f"valid kinds: {valid}")
    try:
        return GateConfig.model_validate(data)
    except ValidationError as e:
        raise GateConfigError(f"{source}: " + "; ".join(_describe(err, data) for err in e.errors())) from None


def _describe(err: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    loc = [p for p in err["loc"] if p not in RULE_KINDS]  # pydantic inserts the union tag into the path
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    message = err["msg"].removeprefix("Value error, ")
    if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
        rule = data["rules"][loc[1]]
        where = where.replace(f"rules[{loc[1]}]", f"rules[{loc[1]}] ({rule.get('name', 'unnamed')})", 1)
        if err["type"] == "extra_forbidden":
            fields = [f for f in RULE_KINDS[rule["kind"]].model_fields if f != "kind"]
            message = f"unknown field{did_you_mean(str(loc[-1]), fields)}; fields of {rule['kind']}: {', '.join(fields)}"
    return f"{where}: {message}"


def evaluate(
    store: Store, run_id: str, rules: GateConfig | Sequence[GateRule], baseline_run_id: str | None = None
) -> list[Verdict]:
    """Verdicts of every rule for ``run_id``; canary rules compare with ``baseline_run_id`` or the manifest's."""
    ctx = _Context(store, run_id, baseline_run_id)
    return [v for rule in (rules.rules if isinstance(rules, GateConfig) else rules) for v in rule.check(ctx)]


def write_verdicts(root: str | os.PathLike[str], run_id: str, verdicts: Sequence[Verdict],
                   rules_path: str | os.PathLike[str]) -> str:
    """Store the verdicts of one rules file in the archive, replacing an earlier evaluation of that file only."""
    rows = [asdict(v) | {"rules_path": str(rules_path)} for v in verdicts]
    return ArchiveWriter(root, run_id).write_verdicts(Path(rules_path).stem, rows)


def exit_code(verdicts: Sequence[Verdict]) -> int:
    """0 when there are verdicts and all passed; 1 otherwise (an empty gate checked nothing)."""
    return 0 if verdicts and all(v.passed for v in verdicts) else 1
