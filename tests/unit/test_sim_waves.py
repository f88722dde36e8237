"""Closed-loop waves, as `pdd bench e2e` runs its agents: a client's first request of a later
wave starts when every request of the earlier waves has ended (plus its think time)."""

from dataclasses import replace

import pytest

from pdd.sim.fleet.deployment import RoleSpec, same_dc
from pdd.sim.fleet.simulator import simulate
from pdd.sim.workloads.workload import Workload
from tests.sim_util import FLAT, TINY, request

EXACT = 1e-12


def _run(waves: tuple[int, int, int, int]):
    short, long = request(0, 0.0, 2, 2), request(1, 0.0, 2, 30)  # wave 0: client 0 ends first
    then0, then1 = request(2, 0.1, 2, 2), request(3, 0.2, 2, 2)  # each after its think time
    reqs = [
        replace(r, client=r.rid % 2, wave=w) for r, w in zip((short, long, then0, then1), waves, strict=True)
    ]
    return simulate(
        same_dc(RoleSpec(1, FLAT), RoleSpec(1, FLAT)), Workload("w", 16, tuple(reqs), closed_loop=True), TINY
    ).records


def test_a_later_wave_starts_when_the_earlier_one_ended():
    a, b, c, d = _run((0, 0, 1, 1))
    wave_end = max(a.arrival_s + a.e2e_s, b.arrival_s + b.e2e_s)
    assert b.arrival_s + b.e2e_s > a.arrival_s + a.e2e_s + 0.1  # the long request ends last
    assert c.arrival_s == pytest.approx(wave_end + 0.1, abs=EXACT)
    assert d.arrival_s == pytest.approx(wave_end + 0.2, abs=EXACT)


def test_in_one_wave_each_client_goes_on_alone():
    a, b, c, d = _run((0, 0, 0, 0))
    assert c.arrival_s == pytest.approx(a.arrival_s + a.e2e_s + 0.1, abs=EXACT)
    assert d.arrival_s == pytest.approx(b.arrival_s + b.e2e_s + 0.2, abs=EXACT)
