"""A prefix crosses the WAN once in the simulator: the sharing rule's block arithmetic, and the
simulated MD against shared/engine/in_flight.py (the real MD's rule) on the same events."""

from __future__ import annotations

from dataclasses import replace

from pdd.sim.fleet.deployment import LinkSpec, RoleSpec, naive
from pdd.sim.fleet.sharing import present_upto, tokens_to_send
from pdd.sim.fleet.simulator import SimSettings, simulate
from pdd.sim.workloads.workload import SimRequest
from shared.engine.in_flight import BlocksInFlight
from tests.sim_util import BLOCK, FLAT, TINY, workload

KVBPT = TINY.kv_bytes_per_token
SLOW = LinkSpec(1000.0, 0.01)  # a 4-block prompt (1 KiB) takes ~1 s on the line
A = SimRequest(0, 0.0, 4 * BLOCK, 8, (10, 11, 12, 13))
B = SimRequest(1, 0.1, 5 * BLOCK, 8, (10, 11, 12, 13, 14))  # A's prompt and one block more


def test_tokens_to_send_skip_the_waited_blocks_even_in_part():
    assert tokens_to_send(0, 5 * BLOCK, [0, 1, 2, 3], BLOCK) == BLOCK
    assert tokens_to_send(8, 40, [1], BLOCK) == 32 - 16
    assert tokens_to_send(20, 24, [1], BLOCK) == 0
    assert tokens_to_send(0, 40, [], BLOCK) == 40
    assert tokens_to_send(30, 30, [0], BLOCK) == 0


def test_present_upto_stops_at_the_first_block_without_its_kv():
    assert present_upto(1, 5, lambda j: j != 3) == 3
    assert present_upto(2, 2, lambda j: True) == 2


def _run(*reqs: SimRequest, share: bool = True):
    d = naive(RoleSpec(1, FLAT), RoleSpec(1, FLAT), SLOW)
    return simulate(d, workload(*reqs), TINY, replace(SimSettings(), share_in_flight=share)).records


def test_two_requests_sharing_a_prefix_in_flight_carry_it_once():
    """B arrives while A's 4 blocks are on the line: it sends only its own fifth block, and
    decodes only once A's blocks have landed too."""
    a, b = _run(A, B)
    f = BlocksInFlight()  # the real MD's rule on the same claims
    assert f.claim("0", list(A.block_hashes)) == ([10, 11, 12, 13], [])
    assert f.claim("1", list(B.block_hashes)) == ([14], [10, 11, 12, 13])
    assert (a.wan_bytes, b.wan_bytes) == (4 * BLOCK * KVBPT, 1 * BLOCK * KVBPT)
    assert (b.wan_waited_blocks, b.md_recomputed_tokens) == (4, 0)
    assert a.believed_wan_bytes + b.believed_wan_bytes == a.wan_bytes + b.wan_bytes
    assert b.arrival_s + b.tt2t_s > a.arrival_s + 1.0  # (A's KV takes ~1 s on the line)
    assert [r.md_tokens for r in (a, b)] == [7, 7]  # every token after the first, on MD
    a0, b0 = _run(A, B, share=False)  # without sharing, B sends the whole prompt again
    assert b0.wan_bytes == 5 * BLOCK * KVBPT and b0.wan_waited_blocks == 0


def test_a_waiter_whose_carrier_ends_recomputes_the_lost_blocks_on_md():
    """A's output ends at its first token: MD drops it before any of its KV was sent, and B,
    waiting for A's blocks, gets them by MD's own extend pass (and still finishes)."""
    a_short = replace(A, output_tokens=1)
    b_soon = replace(B, arrival_s=0.005)  # its prepare reaches MD after A's, before A's drop
    a, b = _run(a_short, b_soon)
    f = BlocksInFlight()
    f.claim("0", list(a_short.block_hashes))
    assert f.claim("1", list(b_soon.block_hashes)) == ([14], [10, 11, 12, 13])
    assert f.dropped("0") == {"1": [10, 11, 12, 13]}
    assert a.wan_bytes == 0 and b.wan_bytes == 1 * BLOCK * KVBPT
    assert (b.wan_waited_blocks, b.md_recomputed_tokens) == (4, 4 * BLOCK)
    assert b.md_tokens == 7 and b.e2e_s > b.ttft_s
