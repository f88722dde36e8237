"""A small fleet's exact records, pinned: routing, handoff, KV bytes and token times of each
request. Any change that moves them (a policy change, or a change to the simulator meant only
to make it faster) shows here; update the figures only for a change meant to move them.

3 P, 2 RLD, 3 MD (FLAT chip: 10 ms steps) behind a 20 kB/s WAN with 47.5 ms one way and up to
10 ms of seeded jitter; 16 requests of 2-5 blocks, most sharing one of three prefixes; the WAN
time threshold sends the longer misses through the relay."""

import pytest

from shared.config import RouterSettings
from shared.sim.deployment import LinkSpec, RoleSpec, pdd, same_dc
from shared.sim.simulator import SimSettings, simulate
from tests.sim_util import FLAT, TINY, request, workload

WAN = LinkSpec(20000.0, 0.0475, 0.01)
SETTINGS = SimSettings(router=RouterSettings(wan_time_threshold_s=0.09))
REQUESTS = [request(i, 0.03 * i, 2 + i % 4, 40 + 17 * (i % 5), first_hash=i % 3 if i % 4 else None) for i in range(16)]
# rid, pipeline, P, RLD, MD, handoff, WAN bytes, RLD tokens, TTFT, e2e, max gap
PDD = [
    (0, 'p-md', 'p0', None, 'md0', None, 512, 0, 0.01, 0.6342945517999118, 0.24429455179991183),
    (1, 'p-md', 'p0', None, 'md2', None, 768, 0, 0.010000000000000002, 0.8099196665557936, 0.24991966655579337),
    (2, 'p-rld-md', 'p0', 'rld0', 'md1', 'one-shot', 1024, 27, 0.009999999999999995, 0.8414455211406564, 0.11143550066065633),
    (3, 'p-rld-md', 'p0', 'rld1', 'md1', 'one-shot', 1280, 30, 0.009999999999999995, 1.0221621493076756, 0.12215213394767566),
    (4, 'p-md', 'p1', None, 'md0', None, 512, 0, 0.010000000000000009, 1.3708972018428351, 0.3008972018428353),
    (5, 'p-rld-md', 'p0', 'rld0', 'md2', 'one-shot', 768, 30, 0.010000000000000009, 0.5148114133071674, 0.1248013928271674),
    (6, 'p-md', 'p1', None, 'md0', None, 512, 0, 0.010000000000000009, 0.8731486507672628, 0.31314865076726267),
    (7, 'p-md', 'p0', None, 'md2', None, 512, 0, 0.010000000000000009, 1.0267209628281688, 0.2967209628281686),
    (8, 'p-rld-md', 'p1', 'rld1', 'md0', 'one-shot', 512, 29, 0.010000000000000009, 1.0245034325623779, 0.12449341720237772),
    (9, 'p-md', 'p0', None, 'md1', None, 768, 0, 0.010000000000000009, 1.3828831728045081, 0.31288317280450795),
    (10, 'p-rld-md', 'p1', 'rld0', 'md2', 'one-shot', 256, 28, 0.010000000000000009, 0.5106497294121384, 0.12063970893213838),
    (11, 'p-md', 'p0', None, 'md1', None, 256, 0, 0.010000000000000009, 0.8293068506811762, 0.2693068506811761),
    (12, 'p-rld-md', 'p1', 'rld0', 'md2', 'one-shot', 512, 26, 0.010000000000000009, 0.8507933571726908, 0.12078333669269092),
    (13, 'p-md', 'p0', None, 'md2', None, 0, 0, 0.010000000000000009, 1.1438586193803983, 0.24385861938039843),
    (14, 'p-md', 'p1', None, 'md1', None, 0, 0, 0.010000000000000009, 1.2931526899078012, 0.22315268990780107),
    (15, 'p-md', 'p0', None, 'md1', None, 0, 0, 0.010000000000000009, 0.612161489686246, 0.22216148968624605),
]
SAME_DC = [
    (0, 'p-md', 'p0', None, 'd0', None, 512, 0, 0.01, 0.40001001024000005, 0.01001001024),
    (1, 'p-md', 'p0', None, 'd1', None, 768, 0, 0.010000000000000002, 0.5700100153600001, 0.010010015360000006),
    (2, 'p-md', 'p0', None, 'd2', None, 1024, 0, 0.009999999999999995, 0.74001002048, 0.010010020479999993),
    (3, 'p-md', 'p0', None, 'd0', None, 768, 0, 0.009999999999999995, 0.9200100102400001, 0.020010010240000015),
    (4, 'p-md', 'p0', None, 'd1', None, 512, 0, 0.010000000000000009, 1.08001001536, 0.010010015360000013),
    (5, 'p-md', 'p0', None, 'd2', None, 0, 0, 0.010000000000000009, 0.4000100204799999, 0.010010020479999993),
    (6, 'p-md', 'p0', None, 'd0', None, 0, 0, 0.010000000000000009, 0.5700100102400001, 0.010010010240000033),
    (7, 'p-md', 'p0', None, 'd1', None, 512, 0, 0.010000000000000009, 0.7400100153600001, 0.010010015360000013),
    (8, 'p-md', 'p1', None, 'd2', None, 512, 0, 0.010000000000000009, 0.9100100204799999, 0.010010020479999993),
    (9, 'p-md', 'p0', None, 'd0', None, 0, 0, 0.010000000000000009, 1.08001001024, 0.010010010240000033),
    (10, 'p-md', 'p0', None, 'd1', None, 0, 0, 0.010000000000000009, 0.4000100153600001, 0.010010015360000013),
    (11, 'p-md', 'p0', None, 'd2', None, 256, 0, 0.010000000000000009, 0.5700100204799999, 0.010010020479999993),
    (12, 'p-md', 'p1', None, 'd0', None, 512, 0, 0.010000000000000009, 0.7400100102400001, 0.010010010240000033),
    (13, 'p-md', 'p0', None, 'd1', None, 0, 0, 0.010000000000000009, 0.9100100153600003, 0.010010015360000013),
    (14, 'p-md', 'p0', None, 'd2', None, 0, 0, 0.010000000000000009, 1.08001002048, 0.010010020479999937),
    (15, 'p-md', 'p0', None, 'd0', None, 0, 0, 0.010000000000000009, 0.40001001024000005, 0.010010010240000089),
]


def _rows(result):
    return [(r.rid, r.pipeline, r.prefill, r.relay, r.decode, r.handoff_mode, r.wan_bytes, r.rld_tokens,
             r.ttft_s, r.e2e_s, r.max_gap_s) for r in result.records]  # fmt: skip


@pytest.mark.parametrize(
    "fleet, events, end_s, expected",
    [
        (pdd(RoleSpec(3, FLAT), RoleSpec(2, FLAT), RoleSpec(3, FLAT), WAN), 255, 1.7127381594487594, PDD),
        (same_dc(RoleSpec(2, FLAT), RoleSpec(3, FLAT)), 187, 1.50001002048, SAME_DC),
    ],
    ids=["pdd", "same-dc"],
)
def test_a_small_fleets_records_are_pinned(fleet, events, end_s, expected):
    result = simulate(fleet, workload(*REQUESTS), TINY, SETTINGS)
    assert (result.events, result.sim_time_s) == (events, pytest.approx(end_s, abs=1e-12))
    rows = _rows(result)
    assert [r[:8] for r in rows] == [e[:8] for e in expected]
    assert [r[8:] for r in rows] == [pytest.approx(e[8:], abs=1e-12) for e in expected]
