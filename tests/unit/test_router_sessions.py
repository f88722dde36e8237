"""An agentic multi-turn workload replayed against 2 and 3 MDs, no processes: the router's
policy functions place every request, each MD caches the blocks of the requests it served
(a toy cache, unbounded), and instances report their load only every few requests (the router
counts what it sent meanwhile). Sessions must stay with the MD holding their prefix, and no MD
may take much more than its share."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from services.router.routing.assignments import Assignments
from services.router.routing.policy import (
    InstanceLoad,
    RouteWeights,
    choose_main_decode,
    choose_pipeline,
    request_weights,
    wan_cost_s,
)
from shared.config import RouterSettings
from shared.engine import block_hashes

BLOCK = 16
KV_BYTES_PER_TOKEN = 16_384  # the small preset in float32
BANDWIDTH, RTT = 12.5e6, 0.05  # bench's default WAN: 100 Mbit/s, 25 ms each way
REPORT_EVERY = 0.5  # s between two load reports
ARRIVAL = 0.1  # s between two requests
S = RouterSettings()
W = RouteWeights(S.overlap_weight, S.load_weight, S.prefill_weight, S.balance_factor)


def agentic_sessions(n: int, turns: int, seed: int, shared_tokens: int = 512) -> list[list[list[int]]]:
    """Per session, its prompts: a shared system prompt and a task, then every turn extends
    the previous prompt by the answer and a tool result or user message."""
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(1, 250) for _ in range(k)]

    system = tokens(shared_tokens)
    sessions = []
    for _ in range(n):
        prompt = system + tokens(rng.randint(64, 1024))
        prompts = [prompt]
        for _ in range(turns - 1):
            prompt = prompt + tokens(rng.randint(32, 256)) + tokens(rng.randint(16, 512))
            prompts.append(prompt)
        sessions.append(prompts)
    return sessions


@dataclass
class ToyMD:
    name: str
    blocks: set[int] = field(default_factory=set)  # every block it served (never evicted)
    busy_until: list[float] = field(default_factory=list)  # its requests in flight
    served: int = 0

    def prefix_blocks(self, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n

    def running(self, now: float) -> int:
        return sum(1 for t in self.busy_until if t > now)


def replay(num_mds: int, sessions: list[list[list[int]]], seed: int) -> tuple[float, list[int]]:
    """(share of follow-up turns placed on an MD holding the longest prefix, requests per MD)."""
    rng = random.Random(seed)
    mds = [ToyMD(f"md{i}") for i in range(num_mds)]
    sent = Assignments()
    queue = [(s, 0) for s in range(len(sessions))]  # (session, turn) ready to go, in arrival order
    reported_at, reports = -1.0, [InstanceLoad(m.name) for m in mds]
    on_prefix = follow_ups = 0
    now = 0.0
    while queue:
        s, turn = queue.pop(0)
        now += ARRIVAL
        if now - reported_at >= REPORT_EVERY:  # a heartbeat from every MD
            reported_at, reports = now, [InstanceLoad(m.name, running=m.running(now)) for m in mds]
        hashes = block_hashes(sessions[s][turn], BLOCK, "toy")
        cached = {m.name: m.prefix_blocks(hashes) for m in mds}
        prompt = sessions[s][turn]
        missing = {
            name: choose_pipeline(
                len(prompt), blocks * BLOCK, KV_BYTES_PER_TOKEN, BANDWIDTH, RTT, S.wan_time_threshold_s, True
            ).missing_bytes
            for name, blocks in cached.items()
        }
        wan_s = {name: wan_cost_s(b, 0, BANDWIDTH) for name, b in missing.items()}
        weights = request_weights(
            W, len(prompt) * KV_BYTES_PER_TOKEN / BANDWIDTH
        )  # as RouterCore weighs load
        loads = [
            InstanceLoad(r.instance, r.running, pending=sent.pending(("md", r.instance), reported_at))
            for r in reports
        ]
        chosen = choose_main_decode(loads, wan_s, weights)
        md = next(m for m in mds if m.name == chosen)
        if turn > 0:
            follow_ups += 1
            on_prefix += cached[chosen] == max(cached.values())
        sent.record(("md", chosen), now)
        md.blocks.update(hashes)
        md.served += 1
        md.busy_until.append(now + rng.uniform(0.5, 4.0))  # decoding its answer
        if turn + 1 < len(sessions[s]):  # the agent's next step comes after its tool runs
            queue.insert(min(len(queue), rng.randint(2, 12)), (s, turn + 1))
    return on_prefix / follow_ups, [m.served for m in mds]


@pytest.mark.parametrize(
    ("num_mds", "shared_tokens"),
    [(2, 512), (3, 512), (2, 3000)],  # 3000: a prefix every session shares (a code base) weighs ~4 s of WAN
)
def test_sessions_stay_on_the_md_holding_their_prefix_and_no_md_takes_over_one_and_a_half_shares(
    num_mds, shared_tokens
):
    sessions = agentic_sessions(n=12 * num_mds, turns=8, seed=num_mds, shared_tokens=shared_tokens)
    affinity, served = replay(num_mds, sessions, seed=num_mds)
    mean = sum(served) / num_mds
    assert affinity >= 0.9, (affinity, served)
    assert max(served) <= 1.5 * mean, (affinity, served)
