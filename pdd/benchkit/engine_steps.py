"""What each engine service's loop did, read from its /metrics: steps and their seconds, and a
busy engine's seconds between steps (pdd_engine_step_seconds, pdd_engine_between_steps_seconds),
so `pdd sim validate` can charge the serving loop's time between steps beside the steps."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {"pdd_engine_step_seconds": "step", "pdd_engine_between_steps_seconds": "between"}
SCRAPE_TIMEOUT_S = 5.0


def parse(text: str) -> dict[str, float]:
    """{"steps", "step_s", "gaps", "between_s"} of one service's metrics text (0 where absent)."""
    out = {"steps": 0.0, "step_s": 0.0, "gaps": 0.0, "between_s": 0.0}
    for family in text_string_to_metric_families(text):
        kind = FAMILIES.get(family.name)
        for s in family.samples if kind else ():
            if s.name.endswith("_count"):
                out["steps" if kind == "step" else "gaps"] += s.value
            elif s.name.endswith("_sum"):
                out[f"{kind}_s"] += s.value
    return out


def scrape(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each service's figures by process name (one that does not answer is left out)."""
    out = {}
    for name, url in urls.items():
        try:
            out[name] = parse(httpx.get(url, timeout=SCRAPE_TIMEOUT_S).text)
        except httpx.HTTPError:
            continue
    return out


def difference(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """after - before per engine (one missing from either side is left out)."""
    return {n: {k: a[k] - before[n][k] for k in a} for n, a in after.items() if n in before}
