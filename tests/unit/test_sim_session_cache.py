"""MD keeps the KV of the tokens it generated: a session's next turn, which starts with the
previous turn's output, finds it cached."""

from dataclasses import replace

import pytest

from pdd.sim.fleet.deployment import RoleSpec, same_dc
from pdd.sim.fleet.simulator import simulate
from pdd.sim.workloads.agentic import output_block_hashes
from pdd.sim.workloads.workload import Workload
from tests.sim_util import BLOCK, FLAT, TINY, request


def test_the_next_turn_hits_the_previous_turns_output():
    first = replace(request(0, 0.0, 2, 40), client=7)  # 32 + 40 tokens: 4 full blocks but the last token
    out = output_block_hashes(first, BLOCK)
    assert len(out) == 2
    hashes = first.block_hashes + out + (999_001,)  # the whole first turn, then one fresh block
    second = replace(request(1, 0.0, 5, 4), block_hashes=hashes, client=7)
    result = simulate(
        same_dc(RoleSpec(1, FLAT), RoleSpec(1, FLAT)), Workload("t", BLOCK, (first, second), True), TINY
    )
    assert [r.hit_rate for r in result.records] == [0.0, pytest.approx(4 / 5)]
