"""Paired comparisons of one side over another (deployments, variants): the rows of both sides
that share a pair key, the ratio of a percentile with its bootstrap interval
(pdd/benchkit/bootstrap.py), a target judged on it, the table; and the rotating order that
lets machine noise hit every side alike."""

from __future__ import annotations

import math

from pdd.benchkit.bootstrap import Interval, fmt, percentile, ratio_interval, resolves, verdict


def rotate(xs: list, r: int) -> list:
    r %= len(xs)
    return xs[r:] + xs[:r]


def pairs(
    rows: list[dict], side: str, x: str, y: str, key: tuple[str, ...] | str
) -> tuple[list[dict], list[dict]]:
    """The rows of side x and of side y that share a pair key, aligned (by key)."""
    fields = (key,) if isinstance(key, str) else key
    by = {d: {tuple(r[f] for f in fields): r for r in rows if r[side] == d} for d in (x, y)}
    keys = sorted(by[x].keys() & by[y].keys())
    return [by[x][k] for k in keys], [by[y][k] for k in keys]


def paired_ratio(xs: list[dict], ys: list[dict], key: str, q: float) -> dict:
    """The q-th percentile of `key` over xs / over ys (successful requests), paired, as JSON;
    n: the pairs where both sides succeeded."""

    def values(rs: list[dict]) -> list[float]:
        return [r[key] if r["ok"] and r[key] is not None else math.nan for r in rs]

    a, b = values(xs), values(ys)
    n = sum(not (math.isnan(u) or math.isnan(v)) for u, v in zip(a, b, strict=True))
    return {**ratio_interval(a, b, percentile(q), paired=True).as_json(), "n": n}


def fmt_ratio(ratio: dict) -> str:
    return fmt(Interval.from_json(ratio))


def ratio_target(what: str, ratio: dict, goal: float, *, q: float = 50, at_most: bool = True) -> dict:
    """A goal on a ratio of q-th percentiles (or means: q = 50), judged on its interval and on
    whether its n resolves the percentile (pdd/benchkit/bootstrap.py: met / likely / MISSED)."""
    v = verdict(Interval.from_json(ratio), goal, at_most=at_most, resolved=resolves(q, ratio["n"]))
    return {"what": what, "value": fmt_ratio(ratio), "met": v == "met", "verdict": v}


def print_ratios(ratios: dict, metrics: list[tuple[str, str, float]], design: str) -> None:
    """The ratio table; metrics: (label, key, percentile) (a mean counts as the 50th)."""
    if not ratios:
        return
    n = max(r["n"] for rs in ratios.values() for r in rs.values())
    w = 26
    print(f"\n  ratios with 90% bootstrap intervals, {design}, n = {n} (n.s.: the interval contains 1)")
    short = [label for label, _, q in metrics if not resolves(q, n)]
    if short:
        print(
            f"  (n = {n} does not resolve {', '.join(short)}: those intervals understate the uncertainty, and a"
            " target on them is 'likely' at best)"
        )
    print("  " + f"{'':16s}" + "".join(f"{c:>{w}s}" for c in ratios))
    for label, key, _ in metrics:
        print("  " + f"{label:16s}" + "".join(f"{fmt_ratio(r[key]):>{w}s}" for r in ratios.values()))
