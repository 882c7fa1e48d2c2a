"""Paired statistics: the gate's error rates on simulated runs, McNemar against a hand-computed binomial tail,
clustered against unclustered intervals, the multinomial bootstrap against resampling clusters directly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from synthetic_archive import K2, build_archive

from pipeline.gate import within_limit
from pipeline.stats import paired_delta, ratio_interval
from pipeline.store import Store


def simulated_gsm8k(rng: np.random.Generator, n: int, fp16_only: float, kivi_only: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact-match pairs: fp16 right 43% of the time; KIVI loses a question with probability fp16_only and wins
    one with probability kivi_only (shares of all questions), as the H200 run's KIVI-2 did (119 and 90 of 1,319)."""
    fp16 = (rng.random(n) < 0.43).astype(float)
    flip = rng.random(n)
    kivi = fp16.copy()
    kivi[(fp16 == 1) & (flip < fp16_only / 0.43)] = 0
    kivi[(fp16 == 0) & (flip < kivi_only / 0.57)] = 1
    return fp16, kivi


def regression_passes(fp16: np.ndarray, kivi: np.ndarray, margin: float, seed: int) -> bool:
    d = paired_delta(fp16, kivi, confidence=0.95, seed=seed)
    return within_limit("regression", -d.delta, -d.ci_high, -d.ci_low, margin)


def test_with_no_true_drop_the_regression_gate_passes_at_least_94_percent_of_1000_runs():
    rng = np.random.default_rng(0)
    # Margin 0, the hardest case: a pass needs only that the interval reaches zero.
    passes = [regression_passes(*simulated_gsm8k(rng, 1319, 0.08, 0.08), margin=0.0, seed=i) for i in range(1000)]
    assert np.mean(passes) >= 0.94


def test_with_a_true_drop_of_twice_the_margin_the_regression_gate_fails_at_least_90_percent_of_1000_runs():
    rng = np.random.default_rng(1)
    # 16% of the questions discordant, 12 points lost and 4 won: a true drop of 8 points against a margin of 4.
    fails = [not regression_passes(*simulated_gsm8k(rng, 1319, 0.12, 0.04), margin=4.0, seed=i) for i in range(1000)]
    assert np.mean(fails) >= 0.90


def exact_two_sided_binomial(k: int, n: int) -> float:
    """P(X <= min(k, n - k)) doubled for X ~ Binomial(n, 1/2), capped at 1: the exact McNemar p-value."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


@pytest.mark.parametrize("fp16_only, kivi_only", [(18, 0), (119, 90), (45, 31), (3, 3), (0, 1)])
def test_the_mcnemar_p_value_is_the_exact_binomial_tail_of_the_discordant_pairs(fp16_only, kivi_only):
    concordant = 40
    fp16 = np.array([1.0] * fp16_only + [0.0] * kivi_only + [1.0, 0.0] * (concordant // 2))
    kivi = np.array([0.0] * fp16_only + [1.0] * kivi_only + [1.0, 0.0] * (concordant // 2))
    d = paired_delta(fp16, kivi)
    assert d.test == "mcnemar"
    assert d.p_value == pytest.approx(exact_two_sided_binomial(kivi_only, fp16_only + kivi_only), rel=1e-9)
    assert d.delta == pytest.approx(100 * (kivi_only - fp16_only) / len(fp16))


def test_a_cluster_of_correlated_requests_widens_the_interval():
    rng = np.random.default_rng(2)
    clusters = np.repeat(np.arange(16), 12)  # 16 LongBench-like tasks of 12 records
    effect = rng.normal(0, 0.08, 16)[clusters]  # each task moves as a whole
    fp16 = rng.random(len(clusters))
    kivi = np.clip(fp16 + effect + rng.normal(0, 0.01, len(clusters)), 0, 1)
    clustered = paired_delta(fp16, kivi, clusters.astype(str))
    independent = paired_delta(fp16, kivi)
    assert clustered.delta == pytest.approx(independent.delta)
    assert clustered.ci_high - clustered.ci_low > 2 * (independent.ci_high - independent.ci_low)
    assert clustered.clusters == 16 and independent.clusters == len(clusters)


def test_the_multinomial_bootstrap_matches_resampling_clusters_one_by_one():
    rng = np.random.default_rng(3)
    clusters = rng.integers(0, 9, 60).astype(str)
    fp16, kivi = rng.random(60), rng.random(60)
    d = paired_delta(fp16, kivi, clusters, mean_of_clusters=True, resamples=20000)
    labels = np.unique(clusters)
    means = np.array([100 * (kivi[clusters == c] - fp16[clusters == c]).mean() for c in labels])
    direct = means[rng.integers(0, len(labels), (20000, len(labels)))].mean(axis=1)
    low, high = np.quantile(direct, [0.025, 0.975])
    assert d.delta == pytest.approx(means.mean())
    assert (d.ci_low, d.ci_high) == (pytest.approx(low, abs=0.3), pytest.approx(high, abs=0.3))
    assert d.mde == pytest.approx((1.959964 + 0.841621) * direct.std(), rel=0.03)


def test_one_cluster_gives_no_interval_and_unequal_lists_are_refused():
    d = paired_delta([0.5, 0.7], [0.4, 0.6], clusters=["t", "t"])
    assert (d.ci_low, d.ci_high, d.mde, d.clusters) == (None, None, None, 1) and d.delta == pytest.approx(-10.0)
    with pytest.raises(ValueError, match="two equal, non-empty lists"):
        paired_delta([1.0], [1.0, 0.0])


def test_the_ratio_interval_resamples_each_side_and_needs_two_timings():
    r = ratio_interval([100.0, 110.0, 90.0, 100.0], [150.0, 160.0, 140.0, 150.0])
    assert r.ratio == pytest.approx(1.5) and 140 / 105 <= r.ci_low < 1.5 < r.ci_high <= 160 / 95
    assert ratio_interval([100.0], [150.0, 160.0]).ci_low is None


def test_the_store_views_carry_the_same_deltas_as_the_point_views_with_intervals_around_them(tmp_path):
    with Store(build_archive(tmp_path)) as store:
        stats = {(r["workload"], r["cache"]): r for r in store.records("SELECT * FROM kivi_delta_stats WHERE run_id = 'nightly-a'")}
        points = store.records("SELECT workload, cache, fp16_score, kivi_score, delta_points, n_pairs FROM kivi_deltas "
                               "WHERE run_id = 'nightly-a'")
        task = store.records("SELECT * FROM kivi_task_delta_stats WHERE run_id = 'nightly-a' AND task = 'narrativeqa' "
                             "AND cache = $1", [K2])
        baseline = store.records("SELECT * FROM baseline_delta_stats('canary-b', 'nightly-a') WHERE workload = 'gsm8k' "
                                 "AND cache = $1", [K2])
    assert len(stats) == len(points) == 6
    for p in points:
        s = stats[(p["workload"], p["cache"])]
        assert s["delta_points"] == pytest.approx(p["delta_points"]) and s["n_pairs"] == p["n_pairs"]
        # The scores too, in the same units (fractions), LongBench's as the mean of its task means.
        assert (s["fp16_score"], s["kivi_score"]) == pytest.approx((p["fp16_score"], p["kivi_score"]))
        assert s["ci_low"] <= s["delta_points"] + 1e-9 and s["delta_points"] <= s["ci_high"] + 1e-9
    assert stats[("longbench", K2)]["clusters"] == 3 and stats[("niah", K2)]["clusters"] == 9
    assert stats[("gsm8k", K2)]["test"] == "mcnemar" and stats[("longbench", K2)]["test"] == "bootstrap"
    assert task[0]["delta_points"] == pytest.approx(-2.25) and task[0]["n_pairs"] == 4
    # canary-b answers the question nightly-a's kivi-2 errored on: +5 points, paired by request id.
    assert baseline[0]["delta_points"] == pytest.approx(5.0) and baseline[0]["p_value"] == 1.0
    assert (baseline[0]["baseline_score"], baseline[0]["candidate_score"]) == pytest.approx((0.65, 0.70))
