"""Migration by token IDs on real services (tiny engines, one real NATS server): an MD or a
relay takes over a request from the prompt plus the tokens already streamed and continues it
exactly, greedy and seeded; a backend drops the requests of a router that stops
heartbeating; a router with nothing alive fails a request with a clear error, never a hang."""

from __future__ import annotations

import asyncio

import pytest

from services.main_decode.service import MainDecodeService
from services.relay.service import RelayService
from services.router.core.errors import APIError
from services.router.service import RouterCore
from shared.bus import subjects
from shared.bus.codec import encode
from shared.bus.connection import flushed, publish, request, subscribe
from shared.bus.messages import (
    Abort,
    AbortReason,
    LoadReport,
    Pipeline,
    PrepareReply,
    PrepareRequest,
    ResumeReply,
    ResumeRequest,
    Role,
    TokenEvent,
)
from shared.config import MainDecodeSettings, RelaySettings, RouterSettings
from shared.engine import SamplingParams
from tests.engine_util import greedy, make_engine, run_all, tokens_of
from tests.polling import until, until_async

PROMPT = [(i * 5 + 3) % 250 for i in range(40)]
N = 24


def reference(params: SamplingParams) -> list[int]:
    engine = make_engine()
    engine.add_request("ref", PROMPT, params)
    return tokens_of(run_all(engine)["ref"])


async def _service(kind: str, nc, tmp_path, **kw):
    if kind == "md":
        settings = MainDecodeSettings(bulk_address="tcp://127.0.0.1:0", secret="s", instance="0", **kw)
        return MainDecodeService(settings, nc, make_engine())
    settings = RelaySettings(local_address=f"unix://{tmp_path}/relay.sock", secret="s", instance="0", **kw)
    return RelayService(settings, nc, make_engine())


async def _collect(nc, rid: str) -> tuple[asyncio.Queue, object]:
    got: asyncio.Queue[TokenEvent] = asyncio.Queue()

    async def on(ev: TokenEvent, raw) -> None:
        await got.put(ev)

    return got, await subscribe(nc, subjects.req(rid, subjects.Req.TOKENS), TokenEvent, on)


async def _tokens_until_finished(got: asyncio.Queue) -> tuple[int, list[int]]:
    """(first index, tokens) of one request's events until its finish."""
    first, tokens = None, []
    async with asyncio.timeout(30):
        while True:
            ev = await got.get()
            first = ev.index if first is None else first
            tokens += ev.tokens
            if ev.finished:
                return first, tokens


@pytest.mark.parametrize("kind", ["md", "relay"])
@pytest.mark.parametrize(
    "params",
    [greedy(N), SamplingParams(temperature=0.9, top_p=0.9, max_tokens=N, ignore_eos=True, seed=1234)],
    ids=["greedy", "seeded"],
)
async def test_a_resumed_request_continues_exactly_where_the_client_is(
    nats_server, nats_security, tmp_path, kind, params
) -> None:
    want = reference(params)
    nc = await nats_security.connect(nats_server, f"{kind}-resume-test")
    service = await _service(kind, nc, tmp_path)
    await service.start()
    try:
        got, sub = await _collect(nc, "m1")
        msg = ResumeRequest("m1", PROMPT, want[:9], params, router="")
        reply = await request(nc, subjects.resume(service.role.value, "0"), msg, ResumeReply, timeout=10)
        assert reply.ok, reply.error
        first, tokens = await _tokens_until_finished(got)
        assert first == 9 and tokens == want[9:]  # from the next index on, the same tokens
        await sub.unsubscribe()
        assert service.jobs == {}
        assert (await service.engine_loop.call(service.engine.stats)).used_blocks == 0
    finally:
        await service.stop()
        await nc.close()


async def test_a_bad_resume_is_refused_with_the_reason(nats_server, nats_security, tmp_path) -> None:
    nc = await nats_security.connect(nats_server, "md-resume-bad")
    md = await _service("md", nc, tmp_path)
    await md.start()
    try:
        msg = ResumeRequest("bad", PROMPT, [], SamplingParams(temperature=-1.0, max_tokens=4))
        reply = await request(nc, subjects.resume("main_decode", "0"), msg, ResumeReply, timeout=10)
        assert not reply.ok and "temperature" in reply.error and md.jobs == {}
    finally:
        await md.stop()
        await nc.close()


async def test_a_backend_drops_the_requests_of_a_router_that_stops_heartbeating(
    nats_server, nats_security, tmp_path
) -> None:
    nc = await nats_security.connect(nats_server, "orphans-test")
    md = await _service("md", nc, tmp_path, orphan_after_s=1.5)
    await md.start()
    try:
        hashes = md.engine.block_hashes(PROMPT)
        for rid, router in (("kept", "alive"), ("dropped", "gone")):  # both wait for KV that never comes
            msg = PrepareRequest(rid, PROMPT, greedy(8), hashes, Pipeline.P_MD, router=router)
            assert (await request(nc, subjects.md_prepare("0"), msg, PrepareReply, timeout=10)).ok

        async def dropped() -> bool:  # "gone" never heartbeats: dropped ~1.5 s after MD started
            await publish(nc, subjects.load("router", "alive"), LoadReport(Role.ROUTER, "alive"))
            return "dropped" not in md.jobs

        await until_async(dropped, 15, 0.25)
        assert list(md.jobs) == ["kept"]
    finally:
        await md.stop()
        await nc.close()


async def test_with_no_live_instance_a_request_fails_clearly_within_its_bound(
    nats_server, nats_security
) -> None:
    nc = await nats_security.connect(nats_server, "lonely-router")
    core = RouterCore(
        RouterSettings(migration_wait_s=1.0), nc, model_id="m", block_size=16, kv_bytes_per_token=512
    )
    await core.start()
    try:
        async with asyncio.timeout(5):
            with pytest.raises(APIError) as err:
                await core.open(PROMPT, greedy(4))
        assert err.value.status == 503 and "no live instance" in str(err.value)
        assert core.streams == {} and core.attempts == {}
    finally:
        await core.stop()
        await nc.close()


async def test_an_abort_that_overtakes_its_admission_still_wins(nats_server, nats_security, tmp_path) -> None:
    """An abort may reach MD before (or while) the prepare that creates its job: the job must
    not start, or must not stay (else it holds its KV until the request timeout)."""
    nc = await nats_security.connect(nats_server, "abort-first-test")
    md = await _service("md", nc, tmp_path)
    await md.start()
    try:
        hashes = md.engine.block_hashes(PROMPT)
        await publish(nc, subjects.abort("early", "router"), Abort("early", AbortReason.DISPATCH_FAILED))
        await flushed(nc)
        await until(lambda: md.was_aborted("early"), 10, 0.05)  # the abort arrives through NATS
        msg = PrepareRequest("early", PROMPT, greedy(8), hashes, Pipeline.P_MD, router="r")
        reply = await request(nc, subjects.md_prepare("0"), msg, PrepareReply, timeout=10)
        assert reply.ok and reply.missing == [] and md.jobs == {}  # it takes no part

        async def prepare_overtaken(m, raw) -> None:  # the abort lands while the prepare runs
            md.aborted[m.rid] = (0.0, Abort(m.rid, AbortReason.DISPATCH_FAILED), Role.ROUTER)
            await md.prepare(m, raw)

        msg = PrepareRequest("overtaken", PROMPT, greedy(8), hashes, Pipeline.P_MD, router="r")
        got: asyncio.Queue = asyncio.Queue()

        async def on(raw) -> None:
            await got.put(raw)

        sub = await nc.subscribe(subjects.md_prepare("1"), cb=on)
        reply_task = asyncio.ensure_future(nc.request(subjects.md_prepare("1"), encode(msg), timeout=10))
        raw = await asyncio.wait_for(got.get(), 10)
        await md.admission.admit(msg, raw, PrepareReply, prepare_overtaken)
        await reply_task
        await sub.unsubscribe()
        assert md.jobs == {} and (await md.engine_loop.call(md.engine.stats)).used_blocks == 0
    finally:
        await md.stop()
        await nc.close()
