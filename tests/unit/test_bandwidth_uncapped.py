"""Bandwidth 0 means uncapped wherever a bandwidth is read: the WAN emulator's settings and
control API, the router's link prior and route costs, `pdd up`'s flags, the simulator's link."""

from __future__ import annotations

import math
import random

from pdd.launch import UpOptions, service_spec
from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.link import Link
from pdd.sim.studies.validate import wan_link
from services.router.routing.policy import LinkView, RouteContext, md_options, md_weights
from services.router.routing.prefix_index import PrefixIndex
from shared.config import UNCAPPED_BANDWIDTH_BPS, RouterSettings
from shared.wan.emulator import LinkUpdate
from shared.wan.shaper import LinkSettings, Shaper


def test_the_emulator_takes_0_as_no_cap():
    settings = LinkSettings(delay_ms=0, jitter_ms=0, bandwidth_mbps=0)
    settings.validate()
    assert settings.rate_bps is None
    assert Shaper(settings).serialize(10 << 20, now=5.0) == 5.0  # no pacing at all
    assert LinkUpdate.model_validate({"bandwidth_mbps": 0}).settings() == {"bandwidth_mbps": 0}


def test_the_router_prior_of_an_uncapped_link_is_finite_and_costs_are_numbers():
    settings = RouterSettings(default_bandwidth_bps=0)
    assert settings.default_bandwidth_bps == UNCAPPED_BANDWIDTH_BPS
    ctx = RouteContext(settings, PrefixIndex(), PrefixIndex(), 16, 16 << 10)
    weights = md_weights(ctx, 4096)  # divided by the prior: a ZeroDivisionError before
    assert all(math.isfinite(w) for w in (weights.overlap, weights.load, weights.prefill))
    options = md_options(
        ctx, 4096, list(range(256)), {"md0": LinkView(settings.default_bandwidth_bps, 0.0, 0)}, True
    )
    ((_, wan_s),) = options.values()
    assert 0 <= wan_s < 0.01


def test_pdd_up_with_bandwidth_0_starts_an_uncapped_wan_and_a_router_with_the_uncapped_prior():
    opts = UpOptions(bandwidth_mbps=0)
    router = service_spec("router", 0, opts)
    prior = next(v for k, v in router.env.items() if k.endswith("DEFAULT_BANDWIDTH_BPS"))
    assert RouterSettings(default_bandwidth_bps=float(prior)).default_bandwidth_bps == UNCAPPED_BANDWIDTH_BPS


def test_the_simulator_reads_0_from_a_bench_config_as_an_uncapped_link():
    spec = wan_link({"bandwidth_mbps": 0, "delay_ms": 10, "jitter_ms": 0})
    assert spec.bandwidth_Bps == math.inf
    loop = EventLoop()
    link = Link(loop, spec, random.Random(1))
    landed = []
    link.send(1 << 30, lambda: landed.append(loop.now), "md0")
    loop.run(until=0.001)
    assert link.backlog == 0  # sent at once: only the delay is left
    loop.run()
    assert landed == [0.01]
