"""P→RLD→MD in the simulator, hand-computed (FLAT chip: 10 ms steps; 512 B of prompt KV over a
1000 B/s WAN with a 47.5 ms crossing), and the simulator driven by the real policy settings.

The shared timeline: P's step ends at 0.01; the relay's copy lands at T = 0.01 + IN_DC_S and
it decodes a token every 10 ms from there. MD's prepare reply is back at 0.095, its 512 B
serialise until 0.607 and land at 0.6545; kv_ready reaches the relay at 0.702, whose step
in progress ends at T + 0.70 (71 tokens then, prefill's first included): the relay reads them
then, its load at T + 0.71 (a second command), and picks the mode."""

import pytest

from pdd.sim.fleet.deployment import IN_DC, LinkSpec, RoleSpec, pdd
from pdd.sim.fleet.simulator import SimSettings, simulate
from shared.config import RelaySettings, RouterSettings
from tests.sim_util import FLAT, TINY, request, workload

EXACT = 1e-12
T = 0.01 + 32 * 16 / IN_DC.bandwidth_Bps + IN_DC.one_way_s
WAN = LinkSpec(1000.0, 0.0475)
FAST_WAN = LinkSpec(20000.0, 0.0475)  # 512 B: 0.026 s + 0.095 s RTT estimated
ALWAYS_RELAY = RouterSettings(wan_time_threshold_s=0.0)


def _pdd(wan: LinkSpec = WAN, count: int = 1):
    return pdd(RoleSpec(count, FLAT), RoleSpec(count, FLAT), RoleSpec(count, FLAT), wan)


def _one(output: int, relay: RelaySettings):
    settings = SimSettings(router=ALWAYS_RELAY, relay=relay)
    (r,) = simulate(_pdd(), workload(request(0, 0.0, 2, output)), TINY, settings).records
    assert 1 + r.rld_tokens + r.md_tokens == r.output_tokens  # each token once
    return r


def test_one_shot_handoff():
    r = _one(200, RelaySettings(catchup_threshold=1000))
    # One-shot at T + 0.71; the final batch is read (73 tokens) and decoding stopped by one more
    # command, at T + 0.72. It reaches MD at T + 0.7675; one extend step samples token 74, at the
    # router T + 0.825; MD's 126 more tokens take 1.26 s.
    assert (r.pipeline, r.handoff_mode, r.filtered) == ("p-rld-md", "one-shot", False)
    assert (r.rld_tokens, r.md_tokens) == (72, 127)
    assert r.tt2t_s == pytest.approx(T + 0.01, abs=EXACT)
    assert r.max_gap_s == pytest.approx(0.105, abs=EXACT)  # the handoff: one crossing, one step, one crossing
    assert r.e2e_s == pytest.approx(T + 0.825 + 1.26, abs=EXACT)
    assert r.wan_bytes == 512


def test_catch_up_handoff():
    r = _one(200, RelaySettings(catchup_threshold=10, catchup_load=4, catchup_max_rounds=4))
    # Batches of 70 (the tokens read at T + 0.70, sent at T + 0.71), 12, 11, 11 (each round trip
    # takes 10.5 steps, the relay waits for its step to end: 11 new tokens a round, above the
    # threshold), then after round 4 the final one of 13: read, and the relay stopped, at
    # T + 1.16 with 117 tokens; MD samples token 118 at T + 1.2175.
    assert (r.handoff_mode, r.rld_tokens, r.md_tokens) == ("catch-up", 116, 83)
    assert r.max_gap_s == pytest.approx(0.105, abs=EXACT)
    assert r.e2e_s == pytest.approx(T + 1.2175 + 0.82 + 0.0475, abs=EXACT)


def test_the_relay_finishing_first_stops_the_wan_transfer():
    r = _one(20, RelaySettings())
    # The relay's 19th token comes at T + 0.19, while the WAN is 105 B into the 512.
    assert (r.pipeline, r.filtered, r.handoff_mode) == ("rld-only", True, None)
    assert (r.rld_tokens, r.md_tokens) == (19, 0)
    assert r.e2e_s == pytest.approx(T + 0.19, abs=EXACT)
    assert r.wan_bytes == round((T + 0.19 - 0.095) * 1000)


def _many(n: int = 12):
    return workload(*(request(i, 0.05 * i, 2 + i % 3, 150) for i in range(n)))


def test_the_wan_time_threshold_moves_requests_to_the_relay():
    def relayed(threshold: float) -> float:
        settings = SimSettings(router=RouterSettings(wan_time_threshold_s=threshold))
        return simulate(_pdd(FAST_WAN, 2), _many(), TINY, settings).summary()["pipelines"]["p-rld-md"]

    assert relayed(0.0) == 1.0
    assert relayed(1e9) == 0.0
    assert 0.0 < relayed(0.12) < 1.0  # only the longer prompts cross too slowly


def test_the_catch_up_threshold_moves_handoffs_to_catch_up():
    def modes(threshold: int) -> set[str | None]:
        settings = SimSettings(router=ALWAYS_RELAY, relay=RelaySettings(catchup_threshold=threshold))
        return {r.handoff_mode for r in simulate(_pdd(FAST_WAN, 2), _many(), TINY, settings).records}

    assert modes(1000) == {"one-shot"}
    assert "catch-up" in modes(5)


def test_the_same_inputs_give_the_same_result():
    jittery = LinkSpec(20000.0, 0.0475, jitter_s=0.02)
    settings = SimSettings(router=RouterSettings(wan_time_threshold_s=0.12), seed=3)
    a = simulate(_pdd(jittery, 2), _many(), TINY, settings)
    b = simulate(_pdd(jittery, 2), _many(), TINY, settings)
    assert a.records == b.records and a.wan_bytes_per_s == b.wan_bytes_per_s
