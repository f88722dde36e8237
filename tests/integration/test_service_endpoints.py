"""Request/reply subjects are nats.micro endpoints: a running service lists each one it
answers under $SRV.INFO, counts their requests under $SRV.STATS, and leaves discovery when it
stops. Real services over a real, secured NATS server."""

from __future__ import annotations

import json

import pytest
from nats.errors import NoRespondersError

from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from shared.bus import subjects
from shared.bus.connection import request
from shared.bus.messages import KVSnapshot, KVSnapshotRequest, Pipeline, PrefillSubmit, SubmitReply
from shared.config import MainDecodeSettings, PrefillSettings
from tests.engine_util import greedy, make_engine


async def _srv(nc, verb: str, name: str) -> dict:
    return json.loads((await nc.request(f"$SRV.{verb}.{name}", b"", timeout=5)).data)


async def test_each_services_request_subjects_are_its_endpoints(nats_server, nats_security):
    md_nc = await nats_security.connect(nats_server, "md", user="main_decode")
    p_nc = await nats_security.connect(nats_server, "prefill", user="prefill")
    nc = await nats_security.connect(nats_server, "probe")
    md = MainDecodeService(
        MainDecodeSettings(bulk_address="tcp://127.0.0.1:0", secret="s", instance="0"), md_nc, make_engine()
    )
    prefill = PrefillService(PrefillSettings(secret="s", instance="0"), p_nc, make_engine())
    await md.start()
    await prefill.start()
    try:
        md_info = await _srv(nc, "INFO", "pdd-main-decode")
        assert md_info["metadata"] == {"instance": "0", "datacenter": md.settings.datacenter}
        assert {e["subject"] for e in md_info["endpoints"]} == {
            subjects.md_prepare("0"),
            subjects.resume("main_decode", "0"),
            subjects.kv_snapshot("main_decode", "0"),
            subjects.md_rdma(md.advertise_address, "offer"),
            subjects.md_rdma(md.advertise_address, "written"),
        }
        p_info = await _srv(nc, "INFO", "pdd-prefill")
        assert {e["subject"] for e in p_info["endpoints"]} == {
            subjects.prefill_submit(),
            subjects.prefill_submit_to("0"),
            subjects.kv_snapshot("prefill", "0"),
        }
        # A request answered through an endpoint is counted there.
        snap = await request(
            nc, subjects.kv_snapshot("prefill", "0"), KVSnapshotRequest(), KVSnapshot, timeout=5
        )
        assert snap.instance == "0"
        stats = await _srv(nc, "STATS", "pdd-prefill")
        counts = {e["subject"]: e["num_requests"] for e in stats["endpoints"]}
        assert counts[subjects.kv_snapshot("prefill", "0")] == 1
    finally:
        await prefill.stop()
        await md.stop()
    with pytest.raises(NoRespondersError):  # stopped: gone from discovery and from its subjects
        await nc.request("$SRV.PING.pdd-prefill", b"", timeout=2)
    with pytest.raises(NoRespondersError):
        await nc.request(subjects.md_prepare("0"), b"", timeout=2)
    for c in (md_nc, p_nc, nc):
        await c.drain()


async def test_a_submit_naming_a_relay_address_but_no_relay_is_refused(nats_server, nats_security):
    # P tells the relay to start on the relay's own subject: without its instance it could not.
    p_nc = await nats_security.connect(nats_server, "prefill", user="prefill")
    nc = await nats_security.connect(nats_server, "router", user="router")
    prefill = PrefillService(PrefillSettings(secret="s", instance="0"), p_nc, make_engine())
    await prefill.start()
    try:
        submit = PrefillSubmit("r1", [1, 2, 3], greedy(4), Pipeline.P_RLD_MD, relay_address="unix:/tmp/x")
        reply = await request(nc, subjects.prefill_submit_to("0"), submit, SubmitReply, timeout=10)
        assert not reply.ok and "relay" in (reply.error or "")
        assert "r1" not in prefill.jobs
    finally:
        await prefill.stop()
        for c in (p_nc, nc):
            await c.drain()
