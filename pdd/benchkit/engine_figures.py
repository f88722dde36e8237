"""What each engine service did, read from its /metrics: its loop's steps and their seconds, a
busy engine's seconds between steps (pdd_engine_step_seconds, pdd_engine_between_steps_seconds)
and prefill's KV tails per path (pdd_kv_tail_seconds, pdd_kv_tail_bytes), so `pdd sim validate`
can charge the serving loop's time between steps and move KV at this host's own rate."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# sample name -> figure (a sample labelled by path gets "_<path>" added: tails_wan, tail_s_local)
SAMPLES = {
    "pdd_engine_step_seconds_count": "steps",
    "pdd_engine_step_seconds_sum": "step_s",
    "pdd_engine_between_steps_seconds_count": "gaps",
    "pdd_engine_between_steps_seconds_sum": "between_s",
    "pdd_kv_tail_seconds_count": "tails",
    "pdd_kv_tail_seconds_sum": "tail_s",
    "pdd_kv_tail_bytes_total": "tail_bytes",
}
SCRAPE_TIMEOUT_S = 5.0


def parse(text: str) -> dict[str, float]:
    """One service's figures from its metrics text: steps, step_s, gaps, between_s (0 where
    absent) and, where it sent KV, tails_<path>, tail_s_<path>, tail_bytes_<path>."""
    out = {"steps": 0.0, "step_s": 0.0, "gaps": 0.0, "between_s": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (key := SAMPLES.get(s.name)) is not None:
                key += f"_{s.labels['path']}" if "path" in s.labels else ""
                out[key] = out.get(key, 0.0) + s.value
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
    """after - before per engine (one missing before is left out; a figure new since, from 0)."""
    return {n: {k: v - before[n].get(k, 0.0) for k, v in a.items()} for n, a in after.items() if n in before}
