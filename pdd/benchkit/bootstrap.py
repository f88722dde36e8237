"""Percentile-bootstrap intervals for the ratio of two statistics of request-level samples.

A benchmark that compares deployment X with deployment Y reports stat(X) / stat(Y): the p99
time to the 2nd token of PDD over naive cross-DC, a median, a mean. One run's ratio moves from
run to run (two runs of the same code gave PDD/naive p99 2nd token x0.51 and x0.74), so a ratio
comes with an interval. `ratio_interval` resamples the requests with replacement B times
(2000), recomputes the ratio on each resample and returns the point (the ratio of the samples
as measured) with the 5th and 95th percentiles of the resampled ratios: a 90% interval.

Two designs:
- independent: X and Y are each resampled on their own. For samples that share nothing but
  their distribution.
- paired: X[i] and Y[i] are the same planned request on two deployments (same prompt, same
  output length). Resampling draws indices i and keeps both halves of each pair, so a request
  that is hard on one side (a cold 3000-token prompt) is drawn for the other side too. The
  workload's mix then moves both sides alike and the interval is about the deployments, not
  about which requests the generator happened to draw; it is usually the narrower one.

Reading an interval: where it contains 1.0 the run does not tell which side is faster or
slower; `fmt` marks it "n.s." (not significant at this level).

A goal on a ratio (`verdict`, e.g. "PDD's p99 2nd token at most naive's": ratio <= 1):
  met     the whole interval meets the goal, and the samples resolve the statistic,
  likely  the point meets it, but the interval does not (the run cannot rule out missing it)
          or the samples do not resolve the statistic,
  MISSED  the point does not meet it.

Limits: a bootstrap only reshuffles what the run saw. A p99 over a few dozen requests is one of
the few slowest, and resampling cannot show tails the run did not sample: the interval then
understates the uncertainty (for medians and means it is a fair one). `resolves` says when a
percentile has at least MIN_BEYOND samples beyond it (p50: 10 samples, p99: 500); below that a
goal is "likely" at best. With one sample per side the interval has zero width and says nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

LEVEL = 0.90
RESAMPLES = 2000
MIN_BEYOND = 5  # samples beyond a percentile for its interval to mean something

# A statistic over axis 1: resamples (B, n) of numbers, or (B, n, k) of k-column records, ->
# one value per resample (B,).
Stat = Callable[[np.ndarray], np.ndarray]


def percentile(q: float) -> Stat:
    """The q-th percentile (numpy's linear interpolation, as the benches' `pct`)."""
    return lambda a: np.percentile(a, q, axis=1)


def mean(a: np.ndarray) -> np.ndarray:
    return np.mean(a, axis=1)


def ratio_of_sums(a: np.ndarray) -> np.ndarray:
    """Of two-column records: sum of column 0 over sum of column 1 (e.g. requests meeting the
    SLA over the seconds they took: a rate)."""
    return a[..., 0].sum(axis=1) / a[..., 1].sum(axis=1)


class Interval(NamedTuple):
    point: float
    lo: float
    hi: float

    def contains(self, x: float = 1.0) -> bool:
        return self.lo <= x <= self.hi

    def scaled(self, factor: float) -> Interval:
        """The interval of factor x ratio, for a factor the bootstrap holds fixed (factor > 0)."""
        return Interval(self.point * factor, self.lo * factor, self.hi * factor)

    def as_json(self) -> dict:
        return {"ratio": self.point, "lo": self.lo, "hi": self.hi}

    @classmethod
    def from_json(cls, d: dict) -> Interval:
        return cls(d["ratio"], d["lo"], d["hi"])


def ratio_interval(
    x: Sequence[float],
    y: Sequence[float],
    stat: Stat,
    *,
    paired: bool = False,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval:
    """stat(x) / stat(y) with its percentile-bootstrap interval at `level` (seeded: repeatable).
    A sample is n numbers or n records of k numbers (shape (n, k)). Samples with a NaN are
    dropped (paired: the whole pair). No sample left on a side: all NaN."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if paired:
        if len(xs) != len(ys):
            raise ValueError(f"paired samples differ in length: {len(xs)} vs {len(ys)}")
        keep = ~(_has_nan(xs) | _has_nan(ys))
        xs, ys = xs[keep], ys[keep]
    else:
        xs, ys = xs[~_has_nan(xs)], ys[~_has_nan(ys)]
    if not len(xs) or not len(ys):
        return Interval(np.nan, np.nan, np.nan)
    rng = np.random.default_rng(seed)
    ix = rng.integers(0, len(xs), size=(resamples, len(xs)))
    iy = ix if paired else rng.integers(0, len(ys), size=(resamples, len(ys)))
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(stat(xs[None])[0] / stat(ys[None])[0])
        ratios = stat(xs[ix]) / stat(ys[iy])
    tail = (1 - level) / 2 * 100
    lo, hi = np.nanpercentile(ratios, [tail, 100 - tail]) if not np.isnan(ratios).all() else (np.nan, np.nan)
    return Interval(point, float(lo), float(hi))


def _has_nan(a: np.ndarray) -> np.ndarray:
    return np.isnan(a).reshape(len(a), -1).any(axis=1)


def resolves(q: float, n: int) -> bool:
    """Whether n samples put MIN_BEYOND of them beyond the q-th percentile (on its far side), so
    that resampling has a tail to move: a median wants 10 samples, a p99 500."""
    return n * min(q, 100 - q) / 100 >= MIN_BEYOND


def verdict(iv: Interval, goal: float, *, at_most: bool = True, resolved: bool = True) -> str:
    """ "met" / "likely" / "MISSED" for the goal ratio <= goal (at_most) or ratio >= goal;
    `resolved`: whether the samples resolve the statistic (`resolves`)."""

    def meets(v: float) -> bool:
        return v <= goal if at_most else v >= goal

    if not meets(iv.point):
        return "MISSED"
    return "met" if resolved and meets(iv.hi if at_most else iv.lo) else "likely"


def fmt(iv: Interval, null: float = 1.0) -> str:
    """ "×0.62 [0.51–0.74]"; " n.s." appended where the interval contains `null`."""
    text = f"×{iv.point:.2f} [{iv.lo:.2f}–{iv.hi:.2f}]"
    return text + " n.s." if iv.contains(null) else text
