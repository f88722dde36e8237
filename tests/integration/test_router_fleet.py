"""The router's choice among many instances as the fleet changes under it (a real RouterCore
on a real NATS connection, fed load reports as its subscription would be): an instance that
joins is used at once, one that leaves is dropped, and requests sent since an instance's last
report count toward its load."""

from __future__ import annotations

import asyncio
import time

from services.router.service import RouterCore
from shared.bus.messages import LoadReport, Pipeline, Role
from shared.config import RouterSettings

PROMPT = [(i * 7 + 1) % 250 for i in range(2000)]  # 0.2 s of prefill, 1 s of KV at the default 1 Gbit/s


async def test_instances_that_join_or_leave_are_used_or_dropped_and_sends_count_until_the_next_report(
    nats_server, nats_security
) -> None:
    nc = await nats_security.connect(nats_server, "fleet-router")
    core = RouterCore(
        RouterSettings(lost_after_s=1.0), nc, model_id="m", block_size=16, kv_bytes_per_token=65536
    )

    def report(role: Role, instance: str, running: int = 0) -> None:
        core.registry.update(
            LoadReport(
                role,
                instance,
                running=running,
                num_blocks=100,
                free_blocks=100,
                address=f"tcp://{instance}:1" if role is Role.MAIN_DECODE else None,
            )
        )

    try:
        for role, instance in ((Role.PREFILL, "p0"), (Role.MAIN_DECODE, "m0"), (Role.MAIN_DECODE, "m1")):
            report(role, instance)
        decision, md, relay, prefill, hashes = core.route(PROMPT, None)
        assert (relay, prefill, decision.pipeline) == (None, "p0", Pipeline.P_MD)
        assert (
            md in ("m0", "m1") and core.route(PROMPT, None)[1] == md
        )  # idle: the prompt picks, the same each time
        core.index.apply("m1", hashes, [])
        core.prefill_index.apply("p1", hashes, [])
        report(Role.PREFILL, "p1", running=1)  # joins, busier, holding the prompt
        assert core.route(PROMPT, None)[1:4] == ("m1", None, "p1")  # the prefix wins over one request of load

        report(Role.MAIN_DECODE, "m2")  # joins holding the prompt too, and idle
        report(Role.MAIN_DECODE, "m1", running=2)
        core.index.apply("m2", hashes, [])
        assert core.route(PROMPT, None)[1] == "m2"
        now = time.monotonic()
        for _ in range(3):
            core.fleet.assignments.record((Role.MAIN_DECODE, "m2"), now)  # as a dispatch does
        report(Role.MAIN_DECODE, "m1", running=1)
        assert {m.instance: m.pending for m in core.fleet.loads(Role.MAIN_DECODE)} == {
            "m0": 0,
            "m1": 0,
            "m2": 3,
        }
        assert core.route(PROMPT, None)[1] == "m1"  # m2 now has 3 requests in flight, m1 1
        report(Role.MAIN_DECODE, "m2", running=3)  # its report shows them: no longer counted twice
        assert [m.pending for m in core.fleet.loads(Role.MAIN_DECODE)] == [0, 0, 0]

        await asyncio.sleep(1.1)  # m2 stops reporting: lost after lost_after_s (1 s)
        for role, instance in ((Role.PREFILL, "p0"), (Role.PREFILL, "p1"), (Role.MAIN_DECODE, "m0")):
            report(role, instance)
        report(Role.MAIN_DECODE, "m1", running=2)
        assert [m.instance for m in core.fleet.loads(Role.MAIN_DECODE)] == ["m0", "m1"]
        assert core.route(PROMPT, None)[1] == "m1"
    finally:
        await nc.close()
