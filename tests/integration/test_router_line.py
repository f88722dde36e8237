"""Admission to the line in a real RouterCore on a real NATS connection, fed load reports as
its subscription would be: a request whose KV cannot cross the line within the gap budget,
with the only relay full, waits at the router; it is dispatched by the relay once the relay
has room (and counts toward the relay until the relay's report shows it), and refused with a
429 (Retry-After) past line_wait_s."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.router.api.app import _api_error
from services.router.core.errors import APIError
from services.router.service import RouterCore
from shared.bus.messages import LoadReport, Pipeline, Role
from shared.config import RouterSettings
from shared.engine import SamplingParams

PROMPT = [(i * 7 + 1) % 250 for i in range(2000)]  # 131 MB of KV: 1.05 s at the default 1 Gbit/s
SETTINGS = RouterSettings(
    lost_after_s=5.0,
    wan_time_threshold_s=0.5,
    line_budget_s=0.5,
    relay_max_requests=1,
    line_wait_s=1.0,
    line_replan_s=0.05,
)


async def test_a_held_request_goes_when_the_relay_frees_and_is_refused_past_the_bound(
    nats_server, nats_security, monkeypatch
) -> None:
    nc = await nats_security.connect(nats_server, "line-router")
    core = RouterCore(SETTINGS, nc, model_id="m", block_size=16, kv_bytes_per_token=65536)
    dispatched = []

    async def dispatch(stream, prefill, catchup) -> None:  # (no instance behind the reports)
        dispatched.append((stream.decision.pipeline, stream.relay_instance, prefill))

    monkeypatch.setattr(core.dispatcher, "_dispatch", dispatch)

    def report(role: Role, instance: str, running: int = 0) -> None:
        address = f"tcp://{instance}:1" if role is Role.MAIN_DECODE else None
        core.registry.update(
            LoadReport(role, instance, running=running, num_blocks=1000, free_blocks=1000, address=address)
        )

    try:
        for role, instance in ((Role.PREFILL, "p0"), (Role.MAIN_DECODE, "m0")):
            report(role, instance)
        report(Role.RELAY, "r0", running=1)  # full
        start = time.monotonic()
        with pytest.raises(APIError) as refused:
            await core.open(PROMPT, SamplingParams(max_tokens=4))
        assert 1.0 <= time.monotonic() - start < 2.0
        assert (refused.value.status, refused.value.headers) == (429, {"Retry-After": "1"})
        assert "saturated" in str(refused.value) and dispatched == []
        assert core.dispatcher.held == 0
        response = await _api_error(None, refused.value)
        assert (response.status_code, response.headers["retry-after"]) == (429, "1")

        start = time.monotonic()
        opened = asyncio.create_task(core.open(PROMPT, SamplingParams(max_tokens=4)))
        await asyncio.sleep(0.3)  # an absence: watched a while, the request stays held
        assert not opened.done() and core.dispatcher.held == 1
        report(Role.RELAY, "r0", running=0)  # room
        stream = await asyncio.wait_for(opened, 1.0)
        assert time.monotonic() - start < 1.0
        assert dispatched == [(Pipeline.P_RLD_MD, "r0", "p0")]
        assert core.dispatcher.held == 0
        # The relay's next report cannot show it while its prefill runs: it still counts there.
        report(Role.RELAY, "r0", running=0)
        assert [r.pending for r in core.fleet.loads(Role.RELAY)] == [1]
        assert core.fleet.plan(PROMPT, None)[0].held  # so the relay is full again
        core.release(stream)
    finally:
        await nc.close()
