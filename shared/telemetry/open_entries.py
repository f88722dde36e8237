"""`pdd_open_entries{service, map}`: how many entries each per-request or per-peer map holds,
read at scrape time from size callbacks, so operators (and tests) see whatever fails to drain.

A map is registered once with `track(service, map, size)`; registering the same pair again
replaces the callback (one instance of each service per process)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

NAME = "pdd_open_entries"
HELP = "Entries held in a per-request or per-peer map (read at scrape time)"
SizeOf = Callable[[], int]


class OpenEntries(Collector):
    def __init__(self) -> None:
        self._sizes: dict[tuple[str, str], SizeOf] = {}
        self._lock = threading.Lock()  # scrapes run on the metrics server's thread

    def track(self, service: str, name: str, size: SizeOf) -> None:
        with self._lock:
            self._sizes[(service, name)] = size

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(NAME, HELP, labels=["service", "map"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(NAME, HELP, labels=["service", "map"])
        with self._lock:
            sizes = list(self._sizes.items())
        for (service, name), size in sizes:
            try:
                family.add_metric([service, name], size())
            except Exception:  # one broken callback must not cost the whole scrape
                log.exception("size of %s/%s failed", service, name)
        yield family
