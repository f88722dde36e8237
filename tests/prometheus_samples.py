"""Read Prometheus text exposition back into numbers (tests compare values before and after)."""

from __future__ import annotations

import contextlib

import httpx

from pdd.system import RunningSystem
from pdd.top import Samples, parse_metrics
from tests.polling import wait_until

Entries = dict[tuple[str, str], float]
# Maps keyed by instance, not by request: they stay filled while the system is up.
# Maps keyed by instance (bounded by the fleet, pruned when one leaves) or with a TTL: not per request.
PER_INSTANCE = frozenset(
    {
        ("router", "registry_reports"),
        ("router", "prefix_index_instances"),
        ("router", "stale_aborted"),
        ("router", "strays"),
        ("prefill", "routers"),
        ("relay", "routers"),
        ("main_decode", "routers"),
        ("prefill", "aborted"),
        ("relay", "aborted"),
        ("main_decode", "aborted"),
    }
)


parse_samples = parse_metrics  # {(sample name, its labels): value} of every sample in the text


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    r = httpx.get(url, headers=headers, timeout=10)
    r.raise_for_status()
    return parse_samples(r.text)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much one sample moved between two scrapes (a sample not there yet counts as 0)."""
    key = (name, frozenset(labels.items()))
    assert key in after, f"no sample {name}{labels}"
    return after[key] - before.get(key, 0.0)


def open_entries(system: RunningSystem, headers: dict[str, str] | None = None) -> Entries:
    """{(service, map): entries} of every service's pdd_open_entries, plus each engine
    service's KV blocks in use as (service, "kv_blocks_used")."""
    entries: Entries = {}
    for url in system.metrics_urls().values():
        for (name, labels), value in scrape(url, headers).items():
            label = dict(labels)
            if name == "pdd_open_entries":
                entries[(label["service"], label["map"])] = value
            elif name == "pdd_kv_blocks_used":
                entries[(label["service"], "kv_blocks_used")] = value
    return entries


def held(entries: Entries) -> Entries:
    """The per-request entries still held (PER_INSTANCE maps are not per request)."""
    return {key: n for key, n in entries.items() if n and key not in PER_INSTANCE}


def wait_until_drained(
    system: RunningSystem, timeout_s: float, headers: dict[str, str] | None = None
) -> Entries:
    """Poll until no service holds a per-request entry; what is still held after timeout_s."""
    left: Entries = {}

    def drained() -> bool:
        left.clear()
        try:
            left.update(held(open_entries(system, headers)))
        except httpx.HTTPError as e:  # a service restarting
            left[("unreachable", str(e))] = 1.0
        return not left

    with contextlib.suppress(TimeoutError):
        wait_until(drained, timeout_s, 0.25)
    return left
