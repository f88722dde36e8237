"""The router's view of every instance's prefix cache stays exact over a real, secured NATS
server: a lost cache event, an instance met for the first time, or a restart makes the router
ask that instance for a snapshot, and only the events after it apply. The periodic snapshot is
set far off, so only these triggers can make the view right. Then real MD and prefill services
feed a router by the same protocol."""

from __future__ import annotations

import pytest

from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from services.router.routing.prefix_index import PrefixIndex
from services.router.service import RouterCore
from shared.bus import subjects
from shared.bus.connection import flushed, publish, request, respond, subscribe
from shared.bus.messages import (
    KVEvents,
    KVSnapshot,
    KVSnapshotRequest,
    Pipeline,
    PrefillSubmit,
    ResumeReply,
    ResumeRequest,
    Role,
    SubmitReply,
)
from shared.config import MainDecodeSettings, PrefillSettings, RouterSettings
from tests.engine_util import greedy, make_engine
from tests.polling import until, until_async

SYNC_WITHIN_S = 5.0  # a broken feed is whole again within this (one snapshot round trip)
WAIT_S = 30  # bound on the test's own slower waits
PROMPT = [(i * 7 + 1) % 250 for i in range(70)]  # four full blocks of 16


async def _router(nats_server, nats_security):
    nc = await nats_security.connect(nats_server, "router", user="router")
    settings = RouterSettings(
        kv_snapshot_every_s=3600.0, kv_snapshot_timeout_s=5.0
    )  # a slow answer must not count as a second ask
    core = RouterCore(settings, nc, model_id="m", block_size=16, kv_bytes_per_token=512)
    await core.start()
    await flushed(nc)
    return core, nc


async def _until(index: PrefixIndex, instance: str, want: set[int], within: float) -> None:
    """Until the index (fed through NATS) holds exactly `want` for the instance."""
    what = lambda: f"index {set(index.blocks(instance))} == {want}"  # noqa: E731
    await until(lambda: index.blocks(instance) == want, within, what=what)


class FakeInstance:
    """Plays one instance's side of the protocol; its snapshot answer is whatever the test sets."""

    def __init__(self, nc, role: Role) -> None:
        self.nc, self.role = nc, role
        self.answer = KVSnapshot(role, "0", "e1", 0, [])
        self.asked = 0

    async def start(self) -> None:
        await subscribe(
            self.nc, subjects.kv_snapshot(self.role.value, "0"), KVSnapshotRequest, self._on_request
        )
        await flushed(self.nc)

    async def _on_request(self, msg: KVSnapshotRequest, raw) -> None:
        self.asked += 1
        await respond(raw, self.answer)

    async def send(self, seq: int, stored=(), evicted=(), epoch: str = "e1") -> None:
        ev = KVEvents(self.role, "0", epoch, seq, list(stored), list(evicted))
        await publish(self.nc, subjects.kv_events(self.role.value, "0"), ev)


@pytest.mark.parametrize("role", [Role.MAIN_DECODE, Role.PREFILL])
async def test_first_contact_a_lost_event_and_a_restart_each_fetch_a_snapshot(
    nats_server, nats_security, role
):
    core, router_nc = await _router(nats_server, nats_security)
    nc = await nats_security.connect(nats_server, role.value, user=role.value)
    index = core.index if role is Role.MAIN_DECODE else core.prefill_index
    other = core.prefill_index if role is Role.MAIN_DECODE else core.index
    fake = FakeInstance(nc, role)
    await fake.start()
    try:
        await fake.send(1, stored=[1])  # never met: the router asks (the cache was empty before 1)
        await fake.send(2, stored=[2])
        await _until(index, "0", {1, 2}, WAIT_S)
        assert fake.asked == 1

        fake.answer = KVSnapshot(role, "0", "e1", 4, [2, 3, 4])  # 3 stored 3 and evicted 1
        await fake.send(4, stored=[4])  # 3 is lost on purpose
        await fake.send(5, stored=[5], evicted=[2])
        await _until(index, "0", {3, 4, 5}, SYNC_WITHIN_S)
        assert fake.asked == 2

        fake.answer = KVSnapshot(role, "0", "e2", 0, [9])  # restarted (with a cache: say it was warmed)
        await fake.send(1, stored=[10], epoch="e2")
        await _until(index, "0", {9, 10}, SYNC_WITHIN_S)
        assert fake.asked == 3 and other.size("0") == 0  # the other role's "0" is another instance
    finally:
        await core.stop()
        await nc.close()
        await router_nc.close()


async def test_events_that_name_another_instance_than_their_subject_are_dropped(nats_server, nats_security):
    core, router_nc = await _router(nats_server, nats_security)
    nc = await nats_security.connect(nats_server, "md", user="main_decode")
    fake = FakeInstance(nc, Role.MAIN_DECODE)
    await fake.start()
    try:
        forged = KVEvents(Role.MAIN_DECODE, "1", "e1", 1, [66])
        await publish(nc, subjects.kv_events("main_decode", "0"), forged)  # "0" speaking for "1"
        await fake.send(1, stored=[1])
        await _until(core.index, "0", {1}, WAIT_S)
        assert core.index.size("1") == 0 and "1" not in core.caches[Role.MAIN_DECODE].feeds
    finally:
        await core.stop()
        await nc.close()
        await router_nc.close()


def _synced_epoch(core: RouterCore, role: Role) -> str | None:
    feed = core.caches[role].feeds.get("0")
    return feed.epoch if feed is not None and not feed.syncing else None


async def _cached(service) -> set[int]:
    return set(await service.engine_loop.call(service.engine.exchange.cached_hashes))


async def test_real_main_decode_and_prefill_keep_the_router_exact(nats_server, nats_security, tmp_path):
    core, router_nc = await _router(nats_server, nats_security)
    md_nc = await nats_security.connect(nats_server, "md", user="main_decode")
    p_nc = await nats_security.connect(nats_server, "prefill", user="prefill")
    md = MainDecodeService(
        MainDecodeSettings(bulk_address="tcp://127.0.0.1:0", secret="s", instance="0"), md_nc, make_engine()
    )
    prefill = PrefillService(PrefillSettings(secret="s", instance="0"), p_nc, make_engine())
    await md.start()
    await prefill.start()
    try:
        synced = lambda: all(_synced_epoch(core, s.role) == s.cache_events.epoch for s in (md, prefill))  # noqa: E731
        await until(
            synced, WAIT_S, 0.05, "the router synced with both"
        )  # idle instances tick: it meets them anyway
        resume = ResumeRequest("r1", PROMPT, [], greedy(8))
        assert (
            await request(router_nc, subjects.resume("main_decode", "0"), resume, ResumeReply, timeout=WAIT_S)
        ).ok
        submit = PrefillSubmit("r2", PROMPT[:40], greedy(8), Pipeline.P_MD)
        assert (
            await request(router_nc, subjects.prefill_submit_to("0"), submit, SubmitReply, timeout=WAIT_S)
        ).ok

        async def cached() -> bool:
            return len(await _cached(md)) >= 4 and len(await _cached(prefill)) >= 2

        await until_async(cached, WAIT_S, 0.05)
        await _until(core.index, "0", await _cached(md), WAIT_S)
        await _until(core.prefill_index, "0", await _cached(prefill), WAIT_S)
        assert core.index.blocks("0") != core.prefill_index.blocks("0")
    finally:
        await prefill.stop()
        await md.stop()
        await core.stop()
        for nc in (md_nc, p_nc, router_nc):
            await nc.close()
