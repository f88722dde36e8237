"""A small fleet's exact records, pinned: routing, handoff, KV bytes and token times of each
request. Any change that moves them (a policy change, or a change to the simulator meant only
to make it faster) shows here; update the figures only for a change meant to move them.

3 P, 2 RLD, 3 MD (FLAT chip: 10 ms steps) behind a 20 kB/s WAN with 47.5 ms one way and up to
10 ms of seeded jitter; 16 requests of 2-5 blocks, most sharing one of three prefixes; the WAN
time threshold sends the longer misses, and those behind the line's queue, through the relay.
The full records are pinned without sharing blocks in flight (the model before it); with it
(the default), the KV bytes per request."""

from dataclasses import replace

import pytest

from pdd.sim.fleet.deployment import LinkSpec, RoleSpec, pdd, same_dc
from pdd.sim.fleet.simulator import SimSettings, simulate
from shared.config import RouterSettings
from tests.sim_util import FLAT, TINY, request, workload

WAN = LinkSpec(20000.0, 0.0475, 0.01)
SETTINGS = SimSettings(
    router=RouterSettings(wan_time_threshold_s=0.09), share_in_flight=False, first_token_at_prefill=True
)
REQUESTS = [
    request(i, 0.03 * i, 2 + i % 4, 40 + 17 * (i % 5), first_hash=i % 3 if i % 4 else None) for i in range(16)
]
# rid, pipeline, P, RLD, MD, handoff, WAN bytes, RLD tokens, TTFT, e2e, max gap
PDD = [
    (0, "p-md", "p0", None, "md0", None, 512, 0, 0.01, 0.6342945517999118, 0.24429455179991183),
    (
        1,
        "p-md",
        "p0",
        None,
        "md2",
        None,
        768,
        0,
        0.010000000000000002,
        0.8099196665557934,
        0.24991966655579337,
    ),
    (
        2,
        "p-rld-md",
        "p0",
        "rld0",
        "md1",
        "one-shot",
        1024,
        29,
        0.009999999999999995,
        0.8483877000967734,
        0.1183776796167732,
    ),
    (
        3,
        "p-rld-md",
        "p0",
        "rld1",
        "md1",
        "one-shot",
        1280,
        33,
        0.009999999999999995,
        1.0191043282637928,
        0.11909431290379269,
    ),
    (
        4,
        "p-md",
        "p1",
        None,
        "md0",
        None,
        512,
        0,
        0.010000000000000009,
        1.3808972018428354,
        0.3108972018428353,
    ),
    (
        5,
        "p-rld-md",
        "p0",
        "rld0",
        "md2",
        "one-shot",
        768,
        32,
        0.010000000000000009,
        0.5248114133071674,
        0.12480139282716729,
    ),
    (
        6,
        "p-rld-md",
        "p1",
        "rld1",
        "md0",
        "one-shot",
        512,
        31,
        0.010000000000000009,
        0.7031486507672626,
        0.12313863540726266,
    ),
    (
        7,
        "p-rld-md",
        "p0",
        "rld0",
        "md2",
        "one-shot",
        512,
        32,
        0.010000000000000009,
        0.8567209628281687,
        0.11671094234816848,
    ),
    (
        8,
        "p-rld-md",
        "p1",
        "rld1",
        "md0",
        "one-shot",
        512,
        29,
        0.010000000000000009,
        1.0245034325623779,
        0.11449341720237771,
    ),
    (9, "p-md", "p0", None, "md1", None, 768, 0, 0.010000000000000009, 1.3898253517606254, 0.319825351760625),
    (
        10,
        "p-rld-md",
        "p1",
        "rld0",
        "md2",
        "one-shot",
        256,
        30,
        0.010000000000000009,
        0.5206497294121382,
        0.12063970893213793,
    ),
    (
        11,
        "p-rld-md",
        "p0",
        "rld1",
        "md1",
        "one-shot",
        256,
        28,
        0.010000000000000009,
        0.6862490296372933,
        0.1162390142772931,
    ),
    (
        12,
        "p-rld-md",
        "p1",
        "rld0",
        "md2",
        "one-shot",
        512,
        27,
        0.010000000000000009,
        0.8589144967942103,
        0.1189044763142102,
    ),
    (
        13,
        "p-md",
        "p0",
        None,
        "md2",
        None,
        0,
        0,
        0.010000000000000009,
        1.1538586193803981,
        0.25385861938039833,
    ),
    (
        14,
        "p-md",
        "p1",
        None,
        "md1",
        None,
        0,
        0,
        0.010000000000000009,
        1.3081873701819962,
        0.23818737018199582,
    ),
    (
        15,
        "p-md",
        "p0",
        None,
        "md1",
        None,
        0,
        0,
        0.010000000000000009,
        0.6152366023342253,
        0.22523660233422516,
    ),
]
SAME_DC = [
    (0, "p-md", "p0", None, "d0", None, 512, 0, 0.01, 0.4000100102400001, 0.01001001024),
    (
        1,
        "p-md",
        "p0",
        None,
        "d1",
        None,
        768,
        0,
        0.010000000000000002,
        0.5700100153600001,
        0.010010015360000006,
    ),
    (2, "p-md", "p0", None, "d2", None, 1024, 0, 0.009999999999999995, 0.74001002048, 0.010010020479999993),
    (
        3,
        "p-md",
        "p0",
        None,
        "d0",
        None,
        768,
        0,
        0.009999999999999995,
        0.9300100102400001,
        0.03001001024000001,
    ),
    (
        4,
        "p-md",
        "p0",
        None,
        "d1",
        None,
        512,
        0,
        0.010000000000000009,
        1.0900100153599999,
        0.020010015360000022,
    ),
    (5, "p-md", "p0", None, "d2", None, 0, 0, 0.010000000000000009, 0.41001002048, 0.02001002048),
    (6, "p-md", "p0", None, "d0", None, 0, 0, 0.010000000000000009, 0.5800100102400001, 0.020010010240000042),
    (
        7,
        "p-md",
        "p0",
        None,
        "d1",
        None,
        512,
        0,
        0.010000000000000009,
        0.7500100153600001,
        0.02001001536000005,
    ),
    (8, "p-md", "p1", None, "d2", None, 512, 0, 0.010000000000000009, 0.9200100204800001, 0.02001002048),
    (9, "p-md", "p0", None, "d0", None, 0, 0, 0.010000000000000009, 1.09001001024, 0.020010010240000042),
    (
        10,
        "p-md",
        "p0",
        None,
        "d1",
        None,
        0,
        0,
        0.010000000000000009,
        0.4100100153600001,
        0.020010015360000077,
    ),
    (11, "p-md", "p0", None, "d2", None, 256, 0, 0.010000000000000009, 0.58001002048, 0.020010020480000057),
    (
        12,
        "p-md",
        "p1",
        None,
        "d0",
        None,
        512,
        0,
        0.010000000000000009,
        0.7500100102400001,
        0.020010010240000098,
    ),
    (13, "p-md", "p0", None, "d1", None, 0, 0, 0.010000000000000009, 0.92001001536, 0.020010015360000077),
    (
        14,
        "p-md",
        "p0",
        None,
        "d2",
        None,
        0,
        0,
        0.010000000000000009,
        1.0900100204800003,
        0.020010020480000057,
    ),
    (
        15,
        "p-md",
        "p0",
        None,
        "d0",
        None,
        0,
        0,
        0.010000000000000009,
        0.41001001024000006,
        0.020010010240000153,
    ),
]


def _rows(result):
    return [
        (
            r.rid,
            r.pipeline,
            r.prefill,
            r.relay,
            r.decode,
            r.handoff_mode,
            r.wan_bytes,
            r.rld_tokens,
            r.ttft_s,
            r.e2e_s,
            r.max_gap_s,
        )
        for r in result.records
    ]


@pytest.mark.parametrize(
    "fleet, events, end_s, expected",
    [
        (pdd(RoleSpec(3, FLAT), RoleSpec(2, FLAT), RoleSpec(3, FLAT), WAN), 322, 1.7282504528154978, PDD),
        (same_dc(RoleSpec(2, FLAT), RoleSpec(3, FLAT)), 200, 1.5100100204800002, SAME_DC),
    ],
    ids=["pdd", "same-dc"],
)
def test_a_small_fleets_records_are_pinned(fleet, events, end_s, expected):
    result = simulate(fleet, workload(*REQUESTS), TINY, SETTINGS)
    assert (result.events, result.sim_time_s) == (events, pytest.approx(end_s, abs=1e-12))
    rows = _rows(result)
    assert [r[:8] for r in rows] == [e[:8] for e in expected]
    assert [r[8:] for r in rows] == [pytest.approx(e[8:], abs=1e-12) for e in expected]


def test_sharing_blocks_in_flight_moves_the_bytes_of_the_requests_that_share_them():
    """Requests 9 and 10 need blocks still on their way to their MD: they send none of them."""
    fleet = pdd(RoleSpec(3, FLAT), RoleSpec(2, FLAT), RoleSpec(3, FLAT), WAN)
    result = simulate(fleet, workload(*REQUESTS), TINY, replace(SETTINGS, share_in_flight=True))
    alone = {r[0]: r[6] for r in PDD}
    moved = {
        r.rid: (alone[r.rid], r.wan_bytes, r.wan_waited_blocks)
        for r in result.records
        if r.wan_bytes != alone[r.rid]
    }
    assert moved == {9: (768, 0, 3), 10: (256, 0, 1)}
    assert sum(r.md_recomputed_tokens for r in result.records) == 0
    assert sum(r.wan_bytes for r in result.records) == 7168
