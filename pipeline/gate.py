"""Regression gate: rules from YAML, evaluated over the store into verdicts and an exit code.

Every rule yields one verdict per cache it covers. Rules on a score delta or a KL say which test they make
on its paired confidence interval (pipeline.stats): `regression` fails when the data show the harm (a drop,
a KL) beyond the limit, the whole interval past it; `non_inferiority` passes only when the data show it
within the limit, the whole interval inside it. Each such verdict carries n, the interval, the p-value and
the minimum detectable effect at that n, and says when n is too small for the limit. A metric the rule needs but the archive lacks (a
workload not run, a cache without rows, a partial run, no baseline) gives a failing verdict whose detail
starts with "missing" or "incomplete": the gate fails closed. Drops are in points (see pipeline.store).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from scipy.stats import binomtest

from kivi.config import cache_name, did_you_mean
from pipeline.archive import ArchiveWriter
from pipeline.errors import ConfigError, InputError, error_message, read_yaml, unknown_field, validation_text
from pipeline.config import RunConfig
from pipeline.names import FP16, GENERATE
from pipeline.stats import TASK_AVERAGED_WORKLOADS, VIEW_CONFIDENCE, PairedDelta, paired_delta
from pipeline.workloads import Workload, resolve_data_dir

if TYPE_CHECKING:
    from pipeline.store import Store

# Scores are averages of floats: 0.70 - 0.68 is 2.0000000000000018 points, which must pass "margin: 2".
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
    # The statistics behind an interval test (None for rules that count cells or compare outputs).
    n: int | None = None
    ci_low: float | None = None  # of `observed`, in its unit, at the rule's confidence
    ci_high: float | None = None
    p_value: float | None = None
    mde: float | None = None
    workload: str | None = None  # the rule's, so the archive can place the verdict without its rules file


@dataclass(frozen=True)
class _Context:
    store: Store
    run_id: str
    baseline_run_id: str | None

    def kivi_caches(self) -> list[str]:
        """Every non-fp16 cache the run produced results, generations or perf rows for."""
        _, rows = self.store.query(
            "SELECT cache FROM results WHERE run_id = $1 UNION SELECT cache FROM generations WHERE run_id = $1 "
            "UNION SELECT cache FROM perf WHERE run_id = $1", [self.run_id]
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
    # The workload kinds (pipeline.workloads.base.Workload.kind) whose results the rule reads.
    reads: ClassVar[tuple[str, ...]] = ("accuracy", "teacher_forced")

    @field_validator("cache", check_fields=False)  # each kind declares its `cache`
    @classmethod
    def _archive_name(cls, cache: str | None) -> str | None:
        """A preset as configs name it (kivi-2) stands for its archive name (kivi-k2v2-g32-r128)."""
        return None if cache is None else cache_name(cache)

    def problems(self, workloads: Mapping[str, Workload], caches: Sequence[str], run_id: str | None = None) -> list[str]:
        """What this rule names that the config does not run (or, given ``run_id``, that run's config did not), each
        with the fix; empty when it can be checked."""
        config, configs = _subject(run_id)
        out = []
        workload_name, task, cache = (getattr(self, f, None) for f in ("workload", "task", "cache"))
        workload = workloads.get(workload_name) if workload_name else None
        if workload_name and workload is None:
            out.append(f"workload {workload_name!r} is not in {configs} workloads ({', '.join(workloads) or 'none'})"
                       f"{did_you_mean(workload_name, workloads)}: "
                       + ("add it there or drop the rule" if run_id is None else "correct the name or drop the rule"))
        elif workload is not None and workload.kind not in self.reads:
            out.append(f"workload {workload_name!r} is of kind {workload.kind!r}; {self.kind} reads "
                       f"{' or '.join(map(repr, self.reads))} workloads")
        if task and workload is not None and task not in workload.tasks():
            out.append(f"task {task!r} is not run by workload {workload_name!r} (tasks: {', '.join(workload.tasks())})"
                       f"{did_you_mean(task, workload.tasks())}")
        if cache and cache not in caches:
            out.append(f"cache {cache!r} is not run by {config} (caches: {', '.join(caches)}){did_you_mean(cache, caches)}: "
                       f"name the archive name of one of {configs} caches"
                       + (", or add its preset to caches" if run_id is None else ""))
        return [f"rule {self.name!r}: {problem}" for problem in out]

    def _verdict(self, cache: str | None, observed: float | None, threshold: float | None, passed: bool, detail: str,
                 baseline_run_id: str | None = None, **stats: Any) -> Verdict:
        return Verdict(self.name, self.kind, cache, observed, threshold, passed, detail, baseline_run_id, **stats,
                       workload=getattr(self, "workload", None))

    def _no_kivi_cache(self, ctx: _Context, threshold: float) -> Verdict:
        return self._verdict(None, None, threshold, False, f"missing: run {ctx.run_id} has no KIVI cache")

    def _no_baseline(self, ctx: _Context, threshold: float) -> Verdict:
        return self._verdict(None, None, threshold, False,
                             f"missing baseline: pass baseline_run_id or set runs.baseline_run_id of {ctx.run_id}")

    def check(self, ctx: _Context) -> list[Verdict]:
        raise NotImplementedError


def _subject(run_id: str | None) -> tuple[str, str]:
    """What a rule is checked against in messages, plain and possessive: the config being run, or a run's."""
    return ("the config", "the config's") if run_id is None else (f"run {run_id}", f"run {run_id}'s")


class IntervalRule(GateRule):
    """A limit on a harm (a drop in points, a KL) judged on its paired confidence interval."""

    test: Literal["regression", "non_inferiority"] = Field(
        "regression", description="regression: fail when the data show the harm past the limit; "
                                  "non_inferiority: pass only when the data show it within the limit")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="of the two-sided interval")

    def _judge(self, cache: str, what: str, harm: float, low: float | None, high: float | None, stat: PairedDelta,
               limit: float, unit: str) -> Verdict:
        """``harm`` and its interval [low, high], larger is worse; ``stat`` gives n, p and the detectable effect.
        ``what`` names the harm ("gsm8k: fp16 40.00, KIVI 35.00, drop"). The detail says why the verdict is what
        it is: a harm past the limit passes a regression test when the data do not show it, and says so."""
        digits = _DIGITS[unit]
        interval = "no interval: one cluster" if low is None else f"{self.confidence:.0%} CI [{low:.{digits}f}, {high:.{digits}f}]"
        p = f", {stat.test} p = {stat.p_value:.2g}" if stat.p_value is not None else ""
        passed = within_limit(self.test, harm, low, high, limit)
        ends = (None, None) if low is None else (f"{low:.{digits}f}", f"{high:.{digits}f}")
        why = _reason(self.test, passed, harm > limit + _EPS, *ends,
                      f"the limit of {limit:g} {unit.removesuffix('s') if limit == 1 else unit}")
        detail = f"{what} {harm:.{digits}f} {unit} ({interval}{p}, n = {stat.n}); {why}"
        if stat.mde is None:
            detail += f"; with one cluster (n = {stat.n}) the verdict rests on a single value, whatever the limit"
        elif stat.mde > limit:
            detail += (f"; n = {stat.n} is too small for a {limit:g}-{unit.removesuffix('s')} limit: the smallest effect "
                       f"it finds with 80% power is {stat.mde:.{digits}f} {unit}")
        return self._verdict(cache, harm, limit, passed, detail, n=stat.n, ci_low=low, ci_high=high,
                             p_value=stat.p_value, mde=stat.mde)


def _reason(test: str, passed: bool, past: bool, near: str | None, far: str | None, bound: str, *, beyond: str = "past",
            inside: str = "within", no_interval: str = "one cluster") -> str:
    """Why a measure passes or fails ``bound`` ("the limit of 3 points") under ``test``, in words: ``past``, whether
    its point estimate lies beyond the bound; ``near`` and ``far``, its interval's ends on the passing and the failing
    side (None without an interval); ``beyond`` and ``inside`` say which side is which ("below", "at or above")."""
    if test == "regression":
        if near is None:
            return f"{inside if passed else beyond} {bound}: without an interval the point estimate decides"
        if not passed:
            return f"{beyond} {bound}: the whole interval lies beyond it, so the harm is shown"
        if past:
            return (f"{beyond} {bound}, but not significantly: the interval reaches back to {near}, and a regression "
                    "test fails only a harm the data show beyond its limit")
        return f"{inside} {bound}"
    if passed:
        return f"shown {inside} {bound}: the whole interval lies {inside} it"
    if near is None:
        return f"not shown {inside} {bound}: non-inferiority needs an interval, and {no_interval} gives none"
    return f"not shown {inside} {bound}: the interval reaches {far}"


_DIGITS = {"points": 2, "nats": 4}


def within_limit(test: str, harm: float, low: float | None, high: float | None, limit: float) -> bool:
    """Whether a harm (larger is worse) with interval [low, high] passes ``limit`` under ``test``. Without an
    interval the point estimate decides a regression test, and non-inferiority cannot be shown."""
    if test == "regression":
        return (harm if low is None else low) <= limit + _EPS
    return high is not None and high < limit - _EPS


class PerCacheRule(GateRule):
    """A rule judged cache by cache: the one its `cache` names (each subclass declares it), or every KIVI cache of the
    run; a run without one fails it."""

    @property
    def threshold(self) -> float:
        """The limit its verdicts report."""
        raise NotImplementedError

    def check(self, ctx: _Context) -> list[Verdict]:
        rows = self._read(ctx)
        verdicts = [self._check_cache(cache, rows) for cache in ([self.cache] if self.cache else ctx.kivi_caches())]
        return verdicts or [self._no_kivi_cache(ctx, self.threshold)]

    def _read(self, ctx: _Context) -> Any:
        """What the rule needs of the run, read once for all its caches."""
        raise NotImplementedError

    def _check_cache(self, cache: str, rows: Any) -> Verdict:
        """The verdict on one cache, from what `_read` returned."""
        raise NotImplementedError


@_register
class MaxDrop(PerCacheRule, IntervalRule):
    """KIVI may score at most `margin` points below fp16 of the same run (workload score, or one task)."""

    kind: Literal["max_drop"]
    workload: str
    task: str | None = Field(None, description="one task instead of the workload score")
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    margin: float = Field(ge=0, description="points (100 × score)")

    @property
    def threshold(self) -> float:
        return self.margin

    def _read(self, ctx: _Context) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        view, where, params = "kivi_deltas", "", [ctx.run_id, self.workload]
        if self.task:
            view, where, params = "kivi_task_deltas", "AND task = $3", [*params, self.task]
        counts = {r["cache"]: r for r in ctx.store.records(f"SELECT * FROM {view} WHERE run_id = $1 AND workload = $2 {where}", params)}
        pairs = ctx.store.records(f"SELECT * FROM kivi_pairs WHERE run_id = $1 AND workload = $2 {where}", params)
        return counts, pairs

    def _check_cache(self, cache: str, rows: tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]) -> Verdict:
        counts, pairs = rows
        what = f"{self.workload}/{self.task}" if self.task else self.workload
        row = counts.get(cache)
        if row is None:
            return self._verdict(cache, None, self.margin, False, f"missing {what} scores for {cache} or fp16")
        if row["n_pairs"] < max(row["n_fp16"], row["n_cache"]):
            detail = f"incomplete {what}: {row['n_pairs']} paired requests of {row['n_fp16']} fp16 / {row['n_cache']} {cache}"
            return self._verdict(cache, 0.0 - row["delta_points"], self.margin, False, detail)
        stat = _score_delta([p for p in pairs if p["cache"] == cache], "fp16_score", "kivi_score", self.workload,
                            self.task, self.confidence)
        drop = 0.0 - stat.delta  # not -x: a zero delta must not print as -0.00
        what_scores = f"{what}: fp16 {100 * row['fp16_score']:.2f}, KIVI {100 * row['kivi_score']:.2f}, drop"
        return self._judge(cache, what_scores, drop, *_drop_interval(stat), stat, self.margin, "points")


@_register
class MaxKL(PerCacheRule, IntervalRule):
    """A KIVI cache's mean teacher-forced KL to fp16 (the fidelity workload) is at most `max_kl` nats: the
    cheapest early signal, seen long before a task score moves."""

    kind: Literal["max_kl"]
    reads: ClassVar[tuple[str, ...]] = ("teacher_forced",)
    workload: str = "fidelity"
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    max_kl: float = Field(gt=0, description="nats per token")

    @property
    def threshold(self) -> float:
        return self.max_kl

    def _read(self, ctx: _Context) -> list[dict[str, Any]]:
        return ctx.store.records(
            "SELECT cache, CAST(meta ->> '$.mean_kl' AS DOUBLE) AS kl FROM results "
            "WHERE run_id = $1 AND workload = $2 AND cache <> $3", [ctx.run_id, self.workload, FP16])

    def _check_cache(self, cache: str, rows: list[dict[str, Any]]) -> Verdict:
        kls = [r["kl"] for r in rows if r["cache"] == cache]
        if not kls or None in kls:
            return self._verdict(cache, None, self.max_kl, False, f"missing {self.workload} KL for {cache}")
        # The KL is already a paired measure (against fp16 on the same text): its reference is zero.
        stat = paired_delta([0.0] * len(kls), kls, confidence=self.confidence, scale=1.0)
        return self._judge(cache, f"{self.workload}: mean KL", stat.delta, stat.ci_low, stat.ci_high, stat,
                           self.max_kl, "nats")


@_register
class CellsEqual(PerCacheRule):
    """Every NIAH cell (task, context length, depth) scores as fp16 does, within `tolerance_points`."""

    kind: Literal["cells_equal"]
    reads: ClassVar[tuple[str, ...]] = ("accuracy",)
    workload: str = "niah"
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    tolerance_points: float = Field(0.0, ge=0)

    @property
    def threshold(self) -> float:
        return 0.0  # its verdicts count differing cells

    def _read(self, ctx: _Context) -> dict[str, dict[tuple, float]]:
        cells: dict[str, dict[tuple, float]] = {}
        for r in ctx.store.records("SELECT * FROM niah_cells WHERE run_id = $1 AND workload = $2", [ctx.run_id, self.workload]):
            cells.setdefault(r["cache"], {})[(r["task"], r["context_length"], r["depth"])] = r["score"]
        return cells

    def _check_cache(self, cache: str, cells: dict[str, dict[tuple, float]]) -> Verdict:
        reference, mine = cells.get(FP16, {}), cells.get(cache, {})
        if not reference or not mine:
            side = FP16 if not reference else cache
            return self._verdict(cache, None, 0.0, False, f"missing {self.workload} cells for {side}")
        unmatched = sorted(reference.keys() ^ mine.keys())
        differing = sorted(k for k in reference.keys() & mine.keys()
                           if 100 * abs(mine[k] - reference[k]) > self.tolerance_points + _EPS)
        notes = [f"{t} L={n} depth={d:g}: missing on one side" for t, n, d in unmatched]
        notes += [f"{t} L={n} depth={d:g}: fp16 {reference[(t, n, d)]:.2f} vs {mine[(t, n, d)]:.2f}" for t, n, d in differing]
        bad = len(unmatched) + len(differing)
        detail = f"{bad} of {len(reference.keys() | mine.keys())} cells differ"
        if notes:
            detail += ": " + "; ".join(notes[:_SHOWN]) + ("; …" if len(notes) > _SHOWN else "")
        return self._verdict(cache, float(bad), 0.0, bad == 0, detail)


@_register
class MinThroughputRatio(PerCacheRule):
    """A KIVI cache's best tokens/s (the batch, without OOM, of the highest mean over the sweep's repeats) is at
    least `ratio` × fp16's best; with repeats, judged on the ratio's bootstrap interval by `test`."""

    kind: Literal["min_throughput_ratio"]
    reads: ClassVar[tuple[str, ...]] = ("throughput",)
    workload: str = "sharegpt"
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    ratio: float = Field(gt=0)
    test: Literal["regression", "non_inferiority"] = Field(
        "regression", description="regression: fail when the interval lies below `ratio`; "
                                  "non_inferiority: pass only when it lies at or above it")

    @property
    def threshold(self) -> float:
        return self.ratio

    def _read(self, ctx: _Context) -> dict[str, dict[str, Any]]:
        return {r["cache"]: r for r in ctx.store.records(
            "SELECT * FROM throughput WHERE run_id = $1 AND workload = $2", [ctx.run_id, self.workload])}

    def _check_cache(self, cache: str, rows: dict[str, dict[str, Any]]) -> Verdict:
        fp16, row = rows.get(FP16), rows.get(cache)
        if row is None or row["throughput_ratio"] is None:
            side = cache if fp16 and fp16["max_tokens_per_s"] is not None else FP16
            return self._verdict(cache, None, self.ratio, False, f"missing {self.workload} throughput for {side}")
        ratio, low, high = row["throughput_ratio"], row["ratio_ci_low"], row["ratio_ci_high"]
        interval = (f"{VIEW_CONFIDENCE:.0%} CI [{low:.2f}, {high:.2f}] over {row['repeats']} timings" if low is not None
                    else "no interval: one timing per point")
        # A shortfall below the ratio is the harm: the interval tests of IntervalRule, mirrored.
        passed = within_limit(self.test, -ratio, None if high is None else -high, None if low is None else -low, -self.ratio)
        ends = (None, None) if low is None else (f"{high:.2f}", f"{low:.2f}")
        why = _reason(self.test, passed, ratio < self.ratio - _EPS, *ends, f"the floor of {self.ratio:g}×",
                      beyond="below", inside="at or above", no_interval="one timing per point")
        detail = (f"{row['max_tokens_per_s']:.1f} tokens/s (batch ≤ {row['max_batch']}) vs fp16 "
                  f"{fp16['max_tokens_per_s']:.1f} (batch ≤ {fp16['max_batch']}): {ratio:.2f}× ({interval}); {why}")
        return self._verdict(cache, ratio, self.ratio, passed, detail, n=row["repeats"], ci_low=low, ci_high=high)


@_register
class NoRegressionVsBaseline(IntervalRule):
    """No workload or task score of any cache falls more than `margin` points below the baseline run, each
    judged by `test` on its interval over the requests both runs answered (paired by request id)."""

    kind: Literal["no_regression_vs_baseline"]
    margin: float = Field(ge=0, description="points (100 × score)")
    workload: str | None = Field(None, description="omitted: every workload of the baseline")
    cache: str | None = Field(None, description="omitted: every cache of the baseline, fp16 included")

    def check(self, ctx: _Context) -> list[Verdict]:
        baseline = ctx.baseline_run_id or _manifest_baseline(ctx)
        if baseline is None:
            return [self._no_baseline(ctx, self.margin)]
        metrics = ctx.store.records("SELECT *, NULL AS task FROM baseline_deltas($1, $2)", [ctx.run_id, baseline])
        metrics += ctx.store.records("SELECT * FROM baseline_task_deltas($1, $2)", [ctx.run_id, baseline])
        metrics = [m for m in metrics if self.workload in (None, m["workload"]) and self.cache in (None, m["cache"])]
        if not metrics:
            return [self._verdict(self.cache, None, self.margin, False,
                                  f"missing: baseline run {baseline} has no scores to compare", baseline)]
        pairs = ctx.store.records("SELECT * FROM baseline_pairs($1, $2)", [ctx.run_id, baseline])
        by_cache: dict[str, list[dict[str, Any]]] = {}
        for m in metrics:
            by_cache.setdefault(m["cache"], []).append(m)
        return [self._compare(cache, ms, [p for p in pairs if p["cache"] == cache], baseline)
                for cache, ms in sorted(by_cache.items())]

    def _compare(self, cache: str, metrics: list[dict[str, Any]], pairs: list[dict[str, Any]], baseline: str) -> Verdict:
        scored = [m for m in metrics if m["candidate_score"] is not None]
        missing = [_label(m) for m in metrics if m["candidate_score"] is None]
        # A candidate mean over fewer requests than the baseline's could hide a regression in the rest.
        short = [f"{_label(m)} ({m['candidate_n']} of {m['baseline_n']} requests)" for m in scored
                 if m["candidate_n"] < m["baseline_n"]]
        versions = [f"{_label(m)} v{m['candidate_version']}≠v{m['baseline_version']}" for m in scored
                    if m["candidate_version"] != m["baseline_version"]]
        failed = [detail for detail in (f"missing in candidate: {', '.join(missing[:_SHOWN])}" if missing else None,
                                        f"incomplete in candidate: {', '.join(short[:_SHOWN])}" if short else None,
                                        f"workload versions differ: {', '.join(versions[:_SHOWN])}" if versions else None)
                  if detail]
        if failed:
            return self._verdict(cache, None, self.margin, False, failed[0], baseline)
        judged = sorted(((0.0 - stat.delta, _label(m), stat) for m in scored
                         for stat in [self._stat(m, pairs)]), key=lambda t: t[0])
        over = [(drop, name, stat) for drop, name, stat in judged
                if not within_limit(self.test, drop, *_drop_interval(stat), self.margin)]
        worst_drop, worst_name, worst = (over or judged)[-1]
        verdict = self._judge(cache, f"worst of {len(judged)} metrics, {worst_name}: drop", worst_drop,
                              *_drop_interval(worst), worst, self.margin, "points")
        if over:
            names = ", ".join(f"{name} −{drop:.2f}" for drop, name, _ in reversed(over[-_SHOWN:]))
            verdict = replace(verdict, passed=False, detail=f"{verdict.detail}; failing: {names}")
        return replace(verdict, baseline_run_id=baseline)

    def _stat(self, metric: dict[str, Any], pairs: list[dict[str, Any]]) -> PairedDelta:
        mine = [p for p in pairs if p["workload"] == metric["workload"] and metric["task"] in (None, p["task"])]
        return _score_delta(mine, "baseline_score", "candidate_score", metric["workload"], metric["task"], self.confidence)


def _score_delta(pairs: list[dict[str, Any]], reference: str, candidate: str, workload: str, task: str | None,
                 confidence: float) -> PairedDelta:
    """The paired delta of one workload's (or, with ``task``, one task's) scores over the store's pairs: clustered
    as the store clusters them, and for a workload that averages its tasks, the mean of the task means."""
    return paired_delta([p[reference] for p in pairs], [p[candidate] for p in pairs],
                        [p["task_cluster" if task else "cluster"] for p in pairs], confidence=confidence,
                        mean_of_clusters=task is None and workload in TASK_AVERAGED_WORKLOADS)


def _drop_interval(stat: PairedDelta) -> tuple[float | None, float | None]:
    """The interval of a drop (−delta)."""
    return (None, None) if stat.ci_low is None else (0.0 - stat.ci_high, 0.0 - stat.ci_low)


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


@_register
class MinExactMatch(PerCacheRule):
    """Of the rows a generate run answered greedily under fp16, at least `min_fraction` have the same output under
    the KIVI cache, token for token (an error or a missing row counts as different): a rollout gated on a team's
    own traffic, which has no references. Judged on the fraction's exact binomial interval by `test`."""

    kind: Literal["min_exact_match"]
    reads: ClassVar[tuple[str, ...]] = ("generations",)
    cache: str | None = Field(None, description="omitted: every KIVI cache of the run")
    min_fraction: float = Field(ge=0, le=1, description="of the greedy rows, identical to fp16's")
    test: Literal["regression", "non_inferiority"] = Field(
        "regression", description="regression: fail when the interval lies below min_fraction; "
                                  "non_inferiority: pass only when it lies at or above it")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="of the two-sided interval")

    @property
    def threshold(self) -> float:
        return self.min_fraction

    def problems(self, workloads: Mapping[str, Workload], caches: Sequence[str], run_id: str | None = None) -> list[str]:
        out = super().problems(workloads, caches, run_id)
        if workloads:
            out.append(f"rule {self.name!r}: min_exact_match reads the generations of a kivi-eval generate run, and "
                       f"{_subject(run_id)[0]} runs workloads: gate a generate run "
                       "with it (kivi-eval generate --gate)")
        return out

    def _rows_to_pass(self) -> int | None:
        """The fewest rows with which non-inferiority can pass (None: no number does): all identical, the exact
        interval's low end is ((1 - confidence) / 2) ** (1 / n)."""
        if self.min_fraction <= 0:
            return 1
        if self.min_fraction >= 1:
            return None
        return math.ceil(math.log((1 - self.confidence) / 2) / math.log(self.min_fraction))

    def _read(self, ctx: _Context) -> dict[str, dict[str, Any]]:
        return {r["cache"]: r for r in ctx.store.records("SELECT * FROM generation_agreement WHERE run_id = $1",
                                                         [ctx.run_id])}

    def _check_cache(self, cache: str, rows: dict[str, dict[str, Any]]) -> Verdict:
        row = rows.get(cache)
        if row is None or not row["greedy_rows"]:
            return self._verdict(cache, None, self.min_fraction, False, f"missing: no greedy fp16 rows beside {cache}")
        n, same = row["greedy_rows"], row["exact"]
        if row["missing"]:
            return self._verdict(cache, same / n, self.min_fraction, False,
                                 f"incomplete: {row['missing']} of fp16's rows have no {cache} row")
        interval = binomtest(same, n).proportion_ci(self.confidence, method="exact")
        low, high = interval.low, interval.high
        passed = within_limit(self.test, -same / n, -high, -low, -self.min_fraction)
        errors = f" ({row['cache_errors']} of them errors under {cache})" if row["cache_errors"] else ""
        detail = (f"{same} of {n} greedy rows identical to fp16{errors}: {same / n:.3f} [{self.confidence:.0%} CI "
                  f"{low:.3f}, {high:.3f}]; {self.test}: {'passes' if passed else 'fails'} {self.min_fraction:g}")
        if not passed and self.test == "non_inferiority":
            needed = self._rows_to_pass()
            if needed is None:
                detail += f"; no n passes: an interval of a finite n never lies at {self.min_fraction:g}"
            elif n < needed:
                detail += (f"; n = {n} is too small: the interval lies above {self.min_fraction:g} only from {needed} "
                           "greedy rows, all identical")
        return self._verdict(cache, same / n, self.min_fraction, passed, detail, n=n, ci_low=low, ci_high=high)


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


def check_config_rules(config: RunConfig, path: str | os.PathLike[str]) -> None:
    """Raise ConfigError unless the rules file of the config read from ``path`` loads and names only what the run
    produces: a rule on anything else would fail closed at the end of a night's run. Cheap: no model loads."""
    if config.gate is None:
        return
    try:
        rules = load_gate(config.gate)
    except GateConfigError as err:
        raise ConfigError(f"{Path(path)}: gate: {err}") from None
    workloads, caches = config.build_workloads(), [c for c in config.kivi_configs() if c != FP16]
    if problems := [problem for rule in rules.rules for problem in rule.problems(workloads, caches)]:
        raise ConfigError(f"{Path(path)}: gate ({config.gate}): {'; '.join(problems)}")


def check_rules_fit_run(store: Store, run_id: str, rules: GateConfig, rules_path: str | os.PathLike[str]) -> None:
    """Raise GateConfigError when a rule names a workload, task or cache that ``run_id``'s config never ran: a
    misspelt name would otherwise read as a failing "missing" verdict. What the run planned and did not write (a
    failed shard) is judged, and fails closed."""
    plan = _run_plan(store, run_id)
    if plan is not None and (problems := [p for rule in rules.rules for p in rule.problems(*plan, run_id=run_id)]):
        raise GateConfigError(f"{rules_path}: {'; '.join(problems)}")


def _run_plan(store: Store, run_id: str) -> tuple[dict[str, Workload], list[str]] | None:
    """The workloads and KIVI caches (archive names) of ``run_id``'s stored config; None where none rebuilds (no
    manifest, or an older run whose workload options or presets have changed since)."""
    rows = store.records("SELECT kind, config_yaml FROM runs WHERE run_id = $1", [run_id])
    raw = yaml.safe_load(rows[0]["config_yaml"] or "") if rows else None
    if not isinstance(raw, dict):
        return None
    try:
        if rows[0]["kind"] == GENERATE:
            return {}, [cache_name(c) for c in raw.get("caches", ()) if c != FP16]
        config = RunConfig.model_construct(**raw | {"data_dir": resolve_data_dir(raw.get("data_dir"))})
        return config.build_workloads(), [c for c in config.kivi_configs() if c != FP16]
    except (AttributeError, TypeError, ValueError):  # a field gone, KiviConfigError…: the verdicts still fail closed
        return None


def load_gate(path: str | os.PathLike[str]) -> GateConfig:
    """Read gate rules from a YAML file (``configs/gates/*.yaml``)."""
    return parse_gate(read_yaml(Path(path), "gate rules file", GateConfigError), source=str(path))


def parse_gate(data: Any, source: str = "gate rules") -> GateConfig:
    """Validate a ``{"rules": [...]}`` mapping; errors name the rule, the field and the valid choices."""
    if not isinstance(data, Mapping):
        raise GateConfigError(f"{source}: expected a mapping with a 'rules' list, got {type(data).__name__}")
    if not isinstance(data.get("rules"), list):
        raise GateConfigError(f"{source}: 'rules' must be a list of rules; found keys {sorted(map(str, data))}")
    try:
        return GateConfig.model_validate(data)
    except ValidationError as e:
        raise GateConfigError(f"{source}: {validation_text(e, partial(_rule_problem, data=data))}") from None


def _rule_problem(err: Mapping[str, Any], data: Mapping[str, Any]) -> tuple[str, str]:
    """(where, message) of one error in ``data``: where names the rule, an unknown kind or field the closest one."""
    loc = [p for p in err["loc"] if p not in RULE_KINDS]  # pydantic inserts the union tag into the path
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    message = error_message(err)
    if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
        rule = data["rules"][loc[1]]
        if not isinstance(rule, Mapping):
            return where, "must be a mapping like {name: …, kind: max_drop, …}"
        where = where.replace(f"rules[{loc[1]}]", f"rules[{loc[1]}] ({rule.get('name', 'unnamed')})", 1)
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            kind = rule.get("kind")
            return f"{where}.kind", (f"{kind!r} is not a rule kind{did_you_mean(kind, RULE_KINDS)}" if kind is not None
                                     else "missing") + f"; valid kinds: {', '.join(RULE_KINDS)}"
        if err["type"] == "extra_forbidden":
            fields = [f for f in RULE_KINDS[rule["kind"]].model_fields if f != "kind"]
            message = f"{unknown_field(str(loc[-1]), fields)}; fields of {rule['kind']}: {', '.join(fields)}"
    return where, message


def evaluate(
    store: Store, run_id: str, rules: GateConfig | Sequence[GateRule], baseline_run_id: str | None = None
) -> list[Verdict]:
    """Verdicts of every rule for ``run_id``; canary rules compare with ``baseline_run_id`` or the manifest's."""
    ctx = _Context(store, run_id, baseline_run_id)
    return [v for rule in (rules.rules if isinstance(rules, GateConfig) else rules) for v in rule.check(ctx)]


def own_rules(store: Store, run_id: str) -> Path | None:
    """The rules file the run's config names (its `gate:`), read from the working directory as configs read it."""
    rows = store.records("SELECT config_yaml FROM runs WHERE run_id = $1", [run_id])
    config = yaml.safe_load(rows[0]["config_yaml"] or "") if rows else None
    return Path(config["gate"]) if isinstance(config, dict) and config.get("gate") else None


def write_verdicts(root: str | os.PathLike[str], run_id: str, verdicts: Sequence[Verdict],
                   rules_path: str | os.PathLike[str]) -> str:
    """Store the verdicts of one rules file in the archive, replacing an earlier evaluation of that file only."""
    rows = [asdict(v) | {"rules_path": str(rules_path)} for v in verdicts]
    return ArchiveWriter(root, run_id).write_verdicts(Path(rules_path).stem, rows)


def exit_code(verdicts: Sequence[Verdict]) -> int:
    """0 when there are verdicts and all passed; 1 otherwise (an empty gate checked nothing)."""
    return 0 if verdicts and all(v.passed for v in verdicts) else 1
