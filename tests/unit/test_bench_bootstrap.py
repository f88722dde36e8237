"""pdd/benchkit/bootstrap.py: percentile-bootstrap intervals of a ratio, on hand-checkable samples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdd.benchkit.bootstrap import (
    Interval,
    fmt,
    mean,
    percentile,
    ratio_interval,
    ratio_of_sums,
    resolves,
    verdict,
)


def test_constant_samples_give_a_zero_width_interval_at_the_point():
    for stat in (percentile(50), percentile(99), mean):
        for paired in (False, True):
            iv = ratio_interval([3.0] * 20, [1.5] * 20, stat, paired=paired)
            assert iv == (2.0, 2.0, 2.0)


def test_pairs_that_keep_their_ratio_give_a_zero_width_interval():
    # Every request takes twice as long on x as on y: resampling pairs can only find x2, while
    # resampling each side on its own mixes fast and slow requests across the sides.
    y = np.random.default_rng(1).lognormal(0.0, 1.0, 60)
    for stat in (percentile(50), percentile(99), mean):
        paired = ratio_interval(2 * y, y, stat, paired=True)
        assert paired.point == pytest.approx(2.0)
        assert paired.lo == pytest.approx(2.0) and paired.hi == pytest.approx(2.0)
        independent = ratio_interval(2 * y, y, stat)
        assert independent.point == pytest.approx(2.0)
        assert independent.lo < 1.8 and independent.hi > 2.2


def test_the_interval_brackets_the_true_ratio():
    # Exponential samples: the true median ratio is (2 ln 2) / (1 ln 2) = 2, the true mean ratio 2.
    rng = np.random.default_rng(7)
    x, y = rng.exponential(2.0, 400), rng.exponential(1.0, 400)
    for stat in (percentile(50), mean):
        iv = ratio_interval(x, y, stat)
        assert iv.lo < 2.0 < iv.hi
        assert iv.lo < iv.point < iv.hi
        assert iv.hi - iv.lo < 0.8  # 400 requests a side resolve a ratio of 2 to within ±20%


def test_coverage_is_near_the_level():
    # Over many repeated "runs", a 90% interval of the median ratio contains the truth (2) in
    # about 90% of them (the percentile bootstrap runs a little short at n = 40).
    rng = np.random.default_rng(3)
    hits = 0
    for run in range(200):
        x, y = rng.exponential(2.0, 40), rng.exponential(1.0, 40)
        iv = ratio_interval(x, y, percentile(50), resamples=500, seed=run)
        hits += iv.lo <= 2.0 <= iv.hi
    assert 0.80 <= hits / 200 <= 0.97


def test_seeded_and_repeatable():
    rng = np.random.default_rng(0)
    x, y = rng.exponential(1.0, 30), rng.exponential(1.0, 30)
    a = ratio_interval(x, y, percentile(99), seed=5)
    assert ratio_interval(x, y, percentile(99), seed=5) == a
    assert ratio_interval(x, y, percentile(99), seed=6) != a


def test_the_point_is_the_ratio_of_the_statistics_as_measured():
    x, y = [1.0, 2.0, 3.0, 10.0], [1.0, 1.0, 2.0, 4.0]
    assert ratio_interval(x, y, percentile(50)).point == pytest.approx(2.5 / 1.5)
    assert ratio_interval(x, y, mean).point == pytest.approx(4.0 / 2.0)
    assert ratio_interval(x, y, percentile(100)).point == pytest.approx(10.0 / 4.0)


def test_nans_are_dropped_pairwise_when_paired():
    nan = math.nan
    iv = ratio_interval([2.0, nan, 6.0, 8.0], [1.0, 1.0, nan, 4.0], mean, paired=True)
    assert iv == (2.0, 2.0, 2.0)  # pairs 0 and 3 remain, both x2
    iv = ratio_interval([2.0, nan, 6.0, 8.0], [1.0, 1.0, nan, 4.0], mean)
    assert iv.point == pytest.approx(16 / 6)  # each side keeps its 3 numbers: 16/3 over 6/3
    assert iv.lo < 2.0 < iv.hi
    assert all(math.isnan(v) for v in ratio_interval([nan], [1.0], mean))
    with pytest.raises(ValueError):
        ratio_interval([1.0, 2.0], [1.0], mean, paired=True)


def test_records_of_two_columns_give_a_rate():
    # (requests meeting the SLA, seconds): x meets 3 in 6 s, y meets 2 in 10 s.
    x = [(1.0, 2.0), (1.0, 2.0), (1.0, 2.0)]
    y = [(1.0, 6.0), (0.0, 2.0), (1.0, 2.0)]
    iv = ratio_interval(x, y, ratio_of_sums, paired=True)
    assert iv.point == pytest.approx((3 / 6) / (2 / 10))
    assert iv.lo < iv.point < iv.hi
    nan = math.nan
    assert ratio_interval(x + [(nan, 1.0)], y + [(1.0, 1.0)], ratio_of_sums, paired=True) == iv


def test_verdict_judges_the_whole_interval():
    assert verdict(Interval(0.6, 0.5, 0.8), 1.0) == "met"
    assert verdict(Interval(0.9, 0.7, 1.1), 1.0) == "likely"
    assert verdict(Interval(1.2, 0.9, 1.4), 1.0) == "MISSED"
    assert verdict(Interval(1.2, 1.1, 1.3), 1.0, at_most=False) == "met"
    assert verdict(Interval(1.1, 0.9, 1.3), 1.0, at_most=False) == "likely"
    assert verdict(Interval(0.9, 0.8, 1.1), 1.0, at_most=False) == "MISSED"
    assert verdict(Interval(1.4, 1.2, 1.6), 1.5) == "likely"
    assert verdict(Interval(0.6, 0.5, 0.8), 1.0, resolved=False) == "likely"
    assert verdict(Interval(1.2, 0.9, 1.4), 1.0, resolved=False) == "MISSED"


def test_a_percentile_is_resolved_with_five_samples_beyond_it():
    assert resolves(50, 10) and not resolves(50, 9)
    assert resolves(99, 500) and not resolves(99, 499)
    assert resolves(1, 500) and not resolves(1, 499)
    assert resolves(90, 50) and not resolves(90, 48)


def test_format_marks_an_interval_that_contains_one():
    assert fmt(Interval(0.62, 0.51, 0.74)) == "×0.62 [0.51–0.74]"
    assert fmt(Interval(0.95, 0.81, 1.10)) == "×0.95 [0.81–1.10] n.s."
    assert fmt(Interval(1.0, 1.0, 1.0)) == "×1.00 [1.00–1.00] n.s."
    iv = Interval(0.5, 0.25, 0.75)
    assert Interval.from_json(iv.as_json()) == iv
    assert iv.as_json() == {"ratio": 0.5, "lo": 0.25, "hi": 0.75}
    assert iv.scaled(2.0) == (1.0, 0.5, 1.5)
