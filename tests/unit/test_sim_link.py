"""The simulated link: FIFO serialisation at the bandwidth, then the propagation delay."""

import random

import pytest

from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.link import Link, LinkSpec


def _link(jitter: float = 0.0, bins: list[float] | None = None) -> tuple[EventLoop, Link]:
    loop = EventLoop()
    return loop, Link(loop, LinkSpec(1000.0, 0.05, jitter), random.Random(1), bins)


def test_transfers_queue_fifo_and_land_after_the_delay():
    loop, link = _link()
    landed = {}
    link.send(100, lambda: landed.setdefault("a", loop.now), "md0")
    link.send(100, lambda: landed.setdefault("b", loop.now), "md1")
    assert link.backlog == 200 and link.backlog_to("md1") == 100
    loop.run(until=0.05)
    assert link.backlog == 150 and link.backlog_to("md0") == 50 and link.backlog_to("md1") == 100
    loop.run()
    assert landed == {"a": pytest.approx(0.15, abs=1e-12), "b": pytest.approx(0.25, abs=1e-12)}
    assert link.backlog == 0


def test_an_abort_frees_the_link_and_counts_what_was_sent():
    loop, link = _link()
    landed = {}
    link.send(100, lambda: landed.setdefault("a", loop.now))
    second = link.send(100, lambda: landed.setdefault("b", loop.now))
    link.send(100, lambda: landed.setdefault("c", loop.now))
    loop.at(0.15, lambda: link.abort(second))  # half of it is on the wire by then
    loop.run()
    assert "b" not in landed
    assert second.sent == 50
    assert landed["c"] == pytest.approx(0.15 + 0.1 + 0.05, abs=1e-12)


def test_an_abort_of_a_queued_transfer_sends_none_of_it():
    loop, link = _link()
    landed = {}
    link.send(100, lambda: landed.setdefault("a", loop.now))
    second = link.send(100, lambda: landed.setdefault("b", loop.now))
    link.send(100, lambda: landed.setdefault("c", loop.now))
    link.abort(second)
    loop.run()
    assert second.sent == 0 and landed["c"] == pytest.approx(0.25, abs=1e-12)


def test_jitter_never_reorders_deliveries():
    loop, link = _link(jitter=0.5)
    order = []
    for i in range(50):
        link.send(1, lambda i=i: order.append((i, loop.now)))
    loop.run()
    assert [i for i, _ in order] == list(range(50))
    times = [t for _, t in order]
    assert times == sorted(times) and max(times) > 0.05 + 0.05  # the jitter did delay some


def test_bytes_serialised_per_second():
    bins: list[float] = []
    loop, link = _link(bins=bins)
    loop.at(0.5, lambda: link.send(1000, lambda: None))  # on the wire from 0.5 to 1.5
    loop.run()
    assert bins == pytest.approx([500.0, 500.0])
