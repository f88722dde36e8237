"""Read Prometheus text exposition back into numbers (tests compare values before and after)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse_samples(text: str) -> Samples:
    """{(sample name, its labels): value} of every sample in the text."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str) -> Samples:
    r = httpx.get(url, timeout=10)
    r.raise_for_status()
    return parse_samples(r.text)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much one sample moved between two scrapes (a sample not there yet counts as 0)."""
    key = (name, frozenset(labels.items()))
    assert key in after, f"no sample {name}{labels}"
    return after[key] - before.get(key, 0.0)
