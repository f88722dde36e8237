"""The metric names (and equality label matchers) a PromQL expression selects: a small
tokenizer, enough for the dashboards' expressions (tests check them against a live scrape)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards/pdd.json"

TOKEN = re.compile(
    r"""
    "(?:\\.|[^"\\])*" | '(?:\\.|[^'\\])*' | `[^`]*`   # strings
  | \[[^\]]*\]                                        # range / subquery: [5m], [$__rate_interval]
  | (?:\d+(?:ms|[smhdwy]))+\b                          # durations: offset 5m, 1h30m
  | \d+(?:\.\d+)?(?:[eE][+-]?\d+)? | \.\d+            # numbers
  | \$\{?\w+\}?                                       # Grafana variables
  | [A-Za-z_:][A-Za-z0-9_:]*                          # identifiers
  | =~ | !~ | != | == | <= | >= | \S                  # operators, punctuation
""",
    re.VERBOSE,
)
FUNCTIONS = frozenset(
    """
    sum avg min max count group stddev stdvar topk bottomk quantile count_values limitk limit_ratio
    rate irate increase delta idelta deriv predict_linear resets changes histogram_quantile
    histogram_count histogram_sum histogram_fraction histogram_avg abs ceil floor round exp ln log2 log10 sqrt
    sgn clamp clamp_min clamp_max scalar vector time timestamp sort sort_desc label_replace label_join absent
    absent_over_time avg_over_time sum_over_time min_over_time max_over_time count_over_time
    quantile_over_time stddev_over_time stdvar_over_time last_over_time present_over_time
""".split()
)
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"})


@dataclass
class Selector:
    name: str
    equal: dict[str, str] = field(default_factory=dict)  # label="value" matchers


def _closing(tokens: list[str], i: int, open_: str, close: str) -> int:
    """Index of the bracket closing tokens[i] (== open_)."""
    depth = 0
    for j in range(i, len(tokens)):
        depth += tokens[j] == open_
        depth -= tokens[j] == close
        if depth == 0:
            return j
    raise ValueError(f"unbalanced {open_!r} in {' '.join(tokens)}")


def _matchers(tokens: list[str]) -> dict[str, str]:
    """label="value" matchers of a `{...}` body (other operators are skipped)."""
    return {
        tokens[k]: json.loads(tokens[k + 2])
        for k in range(len(tokens) - 2)
        if tokens[k + 1] == "=" and tokens[k + 2][:1] == '"'
    }


def selectors(expr: str) -> list[Selector]:
    """Every metric an expression selects, in order."""
    tokens, out, i = TOKEN.findall(expr), [], 0
    while i < len(tokens):
        tok, nxt = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in LABEL_LISTS and nxt == "(":
            i = _closing(tokens, i + 1, "(", ")") + 1  # label names, not metrics
        elif tok in FUNCTIONS and nxt in ("(", "by", "without") or tok in KEYWORDS:  # sum by (le) (...)
            i += 1
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok):
            selector = Selector(tok)
            i += 1
            if nxt == "{":
                end = _closing(tokens, i, "{", "}")
                selector.equal = _matchers(tokens[i + 1 : end])
                i = end + 1
            out.append(selector)
        else:
            i += 1
    return out


def dashboard_exprs(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard, rows' nested panels included."""
    board = json.loads(path.read_text())
    panels = [p for top in board["panels"] for p in (top, *top.get("panels", []))]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
