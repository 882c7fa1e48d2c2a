"""Paired statistics for score deltas: cluster bootstrap intervals, exact McNemar, minimum detectable effect.

A delta compares two caches (or two runs) on the same requests, so each request contributes a pair and the
uncertainty is that of the per-request differences, far smaller than two independent means would give.
Requests that are not independent (the records of one LongBench task, the needles of one NIAH length × depth
cell) form a cluster, and the bootstrap resamples whole clusters.

The bootstrap is exact and cheap: clusters with the same (sum of differences, size) are interchangeable, so a
resample is a multinomial draw of counts over the distinct clusters (three values for a binary metric without
clusters), whatever n is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import binomtest, norm

# Workloads whose headline score is the mean of per-task means (LongBench's official average): their
# tasks are the clusters, and a resample averages the means of the tasks it drew.
TASK_AVERAGED_WORKLOADS = ("longbench",)
RESAMPLES = 2000
VIEW_CONFIDENCE = 0.95  # of the intervals the store's views show; gate rules may ask for their own
POWER = 0.8  # the power the minimum detectable effect is quoted at


@dataclass(frozen=True)
class PairedDelta:
    """scale × (candidate − reference) over paired requests (points at scale 100), with its uncertainty."""

    n: int  # paired requests
    clusters: int
    delta: float
    ci_low: float | None  # two-sided interval at `confidence`; None below two clusters
    ci_high: float | None
    p_value: float | None  # H0: no difference. Exact McNemar for 0/1 scores, else the bootstrap's
    test: str  # "mcnemar" or "bootstrap"
    mde: float | None  # smallest |delta| found at `confidence` with 80% power at this n
    confidence: float
    # The two sides' scores (fractions, each weighted as the delta weighs them): delta = scale × their difference.
    reference_score: float
    candidate_score: float


def paired_delta(reference: Sequence[float], candidate: Sequence[float], clusters: Sequence[str] | None = None,
                 mean_of_clusters: bool = False, confidence: float = 0.95, scale: float = 100.0,
                 resamples: int = RESAMPLES, seed: int = 0) -> PairedDelta:
    """The paired delta of ``candidate`` over ``reference`` (scores in [0, 1], one pair per request).

    ``clusters``: a label per request; None makes every request its own. ``mean_of_clusters``: the estimate
    is the mean of per-cluster means (LongBench's average of task averages) instead of the mean over
    requests. The interval is the bootstrap percentile interval over resampled clusters.
    """
    ref, cand = np.asarray(reference, dtype=float), np.asarray(candidate, dtype=float)
    if ref.shape != cand.shape or ref.ndim != 1 or not len(ref):
        raise ValueError(f"paired scores need two equal, non-empty lists; got {ref.shape} and {cand.shape}")
    labels = np.arange(len(ref)) if clusters is None else np.asarray(clusters)
    _, which = np.unique(labels, return_inverse=True)
    sums, sizes = np.bincount(which, cand - ref), np.bincount(which).astype(float)
    # Per cluster: the numerator and denominator of the estimate, so that a resample's estimate is a ratio of sums.
    num, den = (sums / sizes, np.ones_like(sizes)) if mean_of_clusters else (sums, sizes)
    estimate = float(scale * num.sum() / den.sum())
    scores = {f"{side}_score": float((np.bincount(which, x) / sizes).mean() if mean_of_clusters else x.mean())
              for side, x in (("reference", ref), ("candidate", cand))}
    binary = bool(np.isin(ref, (0.0, 1.0)).all() and np.isin(cand, (0.0, 1.0)).all())
    p_value = _mcnemar(ref, cand) if binary else None
    if len(num) < 2:
        return PairedDelta(len(ref), len(num), estimate, None, None, p_value, "mcnemar" if binary else "bootstrap",
                           None, confidence, **scores)
    distinct, counts = np.unique(np.stack([num, den], axis=1), axis=0, return_counts=True)
    weights = np.random.default_rng(seed).multinomial(len(num), counts / len(num), size=resamples)
    draws = scale * (weights @ distinct[:, 0]) / (weights @ distinct[:, 1])
    alpha = 1 - confidence
    low, high = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    if not binary:  # two-sided: how often the resampled delta falls on the other side of zero
        p_value = min(1.0, max(2 * min((draws <= 0).mean(), (draws >= 0).mean()), 1 / resamples))
    mde = (norm.ppf(1 - alpha / 2) + norm.ppf(POWER)) * draws.std()
    return PairedDelta(len(ref), len(num), estimate, float(low), float(high), float(p_value),
                       "mcnemar" if binary else "bootstrap", float(mde), confidence, **scores)


def _mcnemar(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Exact two-sided McNemar test: the discordant pairs split as a fair coin under H0."""
    only_reference = int(((reference == 1) & (candidate == 0)).sum())
    only_candidate = int(((reference == 0) & (candidate == 1)).sum())
    if only_reference + only_candidate == 0:
        return 1.0
    return float(binomtest(only_candidate, only_reference + only_candidate, 0.5).pvalue)


@dataclass(frozen=True)
class RatioInterval:
    """Mean candidate / mean reference over repeated timings, with a bootstrap interval."""

    ratio: float
    ci_low: float | None  # None with fewer than two timings on either side
    ci_high: float | None
    repeats: int  # the smaller number of timings of the two sides


def ratio_interval(reference: Sequence[float], candidate: Sequence[float], confidence: float = 0.95,
                   resamples: int = RESAMPLES, seed: int = 0) -> RatioInterval:
    """Timings of the two sides are independent: each side is resampled on its own."""
    ref, cand = np.asarray(reference, dtype=float), np.asarray(candidate, dtype=float)
    if not len(ref) or not len(cand):
        raise ValueError("a throughput ratio needs at least one timing on each side")
    ratio = float(cand.mean() / ref.mean())
    repeats = min(len(ref), len(cand))
    if repeats < 2:
        return RatioInterval(ratio, None, None, repeats)
    rng = np.random.default_rng(seed)
    means = [rng.multinomial(len(x), np.full(len(x), 1 / len(x)), size=resamples) @ x / len(x) for x in (ref, cand)]
    alpha = 1 - confidence
    low, high = np.quantile(means[1] / means[0], [alpha / 2, 1 - alpha / 2])
    return RatioInterval(ratio, float(low), float(high), repeats)
