"""The RDMA path for prefill's KV to main decode, on real parts: real PrefillService and
MainDecodeService (tiny engines) on a real secured NATS server, the real Mooncake transfer
engine in its tcp mode. Prefill writes the blocks MD lacks straight into MD's pool slots and MD
caches them only once their checksums hold; whatever goes wrong falls back to the TCP channel
and the request completes with the single-process engine's tokens."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from services.main_decode.service import MainDecodeService
from services.prefill.service import PrefillService
from shared.bus import subjects
from shared.bus.connection import flushed, publish, request, subscribe
from shared.bus.messages import (
    Abort,
    AbortReason,
    MainDecodeTarget,
    Pipeline,
    PrefillSubmit,
    PrepareReply,
    PrepareRequest,
    RdmaOffer,
    RdmaSlots,
    RdmaVerdict,
    RdmaWritten,
    SubmitReply,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import MainDecodeSettings, PrefillSettings, RdmaSettings
from shared.kv.checksum import DEFAULT_ALGO
from shared.kv.rdma.engine import unavailable
from tests.engine_util import greedy, make_engine, run_all, tokens_of
from tests.polling import until

why = unavailable()
pytestmark = pytest.mark.skipif(why is not None, reason=f"rdma extra not usable: {why}")

PROMPT = [(i * 5 + 3) % 250 for i in range(100)]  # 6 full blocks of 16
MAX_TOKENS = 8
WAIT_S = 30  # bound on every wait of the test
TCP_MODE = RdmaSettings(protocol="tcp", host="127.0.0.1", quarantine_s=1.0)


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def reference_tokens() -> list[int]:
    engine = make_engine()
    engine.add_request("ref", PROMPT, greedy(MAX_TOKENS))
    return tokens_of(run_all(engine)["ref"])


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return reference_tokens()


@pytest.fixture
async def services(nats_server, nats_security):
    """Start (md, prefill) on demand, both with the RDMA path in tcp mode unless told otherwise."""
    nc = await nats_security.connect(nats_server, "rdma-test")
    started = []

    async def start(p_rdma: RdmaSettings = TCP_MODE) -> tuple[MainDecodeService, PrefillService, object]:
        md = MainDecodeService(
            MainDecodeSettings(
                bulk_address="tcp://127.0.0.1:0", secret="s", instance="0", kv_transport="rdma", rdma=TCP_MODE
            ),
            nc,
            make_engine(4.0),
        )
        p = PrefillService(
            PrefillSettings(secret="s", instance="0", kv_transport="rdma", rdma=p_rdma), nc, make_engine(4.0)
        )
        for s in (md, p):
            await s.start()
            started.append(s)
        return md, p, nc

    yield start
    for s in reversed(started):
        await s.stop()
    await nc.drain()


async def run_request(md: MainDecodeService, nc, rid: str) -> list[int]:
    """What a router does for a P→MD request: prepare MD, submit to P, give P MD's target;
    the tokens the client would see."""
    events: asyncio.Queue = asyncio.Queue()
    await subscribe(nc, subjects.req(rid, Req.TOKENS), TokenEvent, lambda msg, raw: events.put(msg))
    await flushed(nc)
    prep = PrepareRequest(rid, PROMPT, greedy(MAX_TOKENS), md.engine.block_hashes(PROMPT), Pipeline.P_MD)
    ready = await request(nc, subjects.md_prepare("0"), prep, PrepareReply, timeout=WAIT_S)
    assert ready.ok and ready.missing, ready
    submit = PrefillSubmit(rid, PROMPT, greedy(MAX_TOKENS), Pipeline.P_MD)
    assert (await request(nc, subjects.prefill_submit_to("0"), submit, SubmitReply, timeout=WAIT_S)).ok
    target = MainDecodeTarget(rid, ready.bulk_address, ready.missing, "0")
    await publish(nc, subjects.to_instance("prefill", "0", Req.MD_TARGET), target)
    tokens: dict[int, int] = {}
    async with asyncio.timeout(WAIT_S):
        while True:
            ev = await events.get()
            assert ev.error is None, ev.error
            tokens.update((ev.index + i, t) for i, t in enumerate(ev.tokens))
            if ev.outcome is not None and ev.source.value == "main_decode":
                return [tokens[i] for i in sorted(tokens)]


async def cached(md: MainDecodeService) -> set[int]:
    return set(await md.engine_loop.call(md.engine.exchange.cached_hashes))


async def test_prefill_writes_md_blocks_one_sided_and_md_caches_them(services, reference) -> None:
    md, _, nc = await services()
    rdma_before, fallbacks_before = (
        sample("pdd_kv_rdma_bytes_total"),
        sample("pdd_kv_rdma_fallbacks_total", reason="refused"),
    )
    assert await run_request(md, nc, "r1") == reference
    hashes = md.engine.block_hashes(PROMPT)
    per_block = md.engine.kv_cache[:, :, 0].numel() * md.engine.kv_cache.element_size()
    assert (
        sample("pdd_kv_rdma_bytes_total") - rdma_before == len(hashes) * per_block
    )  # every block, none over TCP
    assert sample("pdd_kv_rdma_fallbacks_total", reason="refused") == fallbacks_before
    assert set(hashes) <= await cached(md)
    assert md.engine.exchange.pins == {} and md.rdma.offered == {} and md.rdma.quarantined == {}


async def test_a_corrupted_block_is_never_cached_and_comes_again_over_tcp(services, reference) -> None:
    md, _, nc = await services()
    flipped: dict[int, int | None] = {}  # hash -> its block in the prefix cache right after verification
    verify = md.rdma._verify

    def flip_then_verify(rid, checks, algo):  # engine thread
        # Injected fault (a bit flip on the fabric cannot be produced here): one byte of the
        # first written slot changes after the write, before MD verifies it.
        h, slot, _ = checks[0]
        md.engine.kv_cache[0, 0, slot].view(-1)[0] += 1.0
        out = verify(rid, checks, algo)
        flipped[h] = md.engine.exchange.pool.block_of(h)
        return out

    md.rdma._verify = flip_then_verify
    corrupt_before = sample("pdd_kv_rdma_corrupt_blocks_total")
    assert await run_request(md, nc, "r2") == reference  # the resent block is the one decoded from
    assert flipped and all(bid is None for bid in flipped.values())  # never cached
    assert sample("pdd_kv_rdma_corrupt_blocks_total") - corrupt_before == len(flipped)
    assert set(md.engine.block_hashes(PROMPT)) <= await cached(md)  # the TCP copies are


async def test_an_engine_that_fails_to_start_falls_back_to_tcp(services, reference) -> None:
    md, p, nc = await services(RdmaSettings(protocol="infiniband-over-carrier-pigeon"))
    assert p.senders.rdma is not None and p.senders.rdma.writer is None
    before = sample("pdd_kv_rdma_fallbacks_total", reason="unavailable")
    assert await run_request(md, nc, "r3") == reference
    assert sample("pdd_kv_rdma_fallbacks_total", reason="unavailable") == before + 1


async def test_a_failed_write_falls_back_to_tcp(services, reference) -> None:
    md, _, nc = await services()
    md.rdma.engine.close()  # MD's pool is no longer registered: the engine refuses the writes into it
    before = sample("pdd_kv_rdma_fallbacks_total", reason="write")
    assert await run_request(md, nc, "r4") == reference
    assert sample("pdd_kv_rdma_fallbacks_total", reason="write") == before + 1
    # slots offered and never written stay out of use for quarantine_s, then go back to the pool
    await until(
        lambda: md.rdma.quarantined == {} and md.engine.exchange.pins == {}, TCP_MODE.quarantine_s + WAIT_S
    )


async def offer(nc, md: MainDecodeService, rid: str, hashes: list[int]) -> RdmaSlots:
    msg = RdmaOffer(rid, hashes)
    return await request(nc, subjects.md_rdma(md.advertise_address, "offer"), msg, RdmaSlots, timeout=WAIT_S)


async def written(nc, md: MainDecodeService, rid: str, hashes: list[int], sums: list[int]) -> RdmaVerdict:
    msg = RdmaWritten(rid, hashes, sums, DEFAULT_ALGO)
    return await request(
        nc, subjects.md_rdma(md.advertise_address, "written"), msg, RdmaVerdict, timeout=WAIT_S
    )


async def test_md_gives_slots_only_for_announced_requests_and_their_missing_blocks(services) -> None:
    md, _, nc = await services()
    hashes = md.engine.block_hashes(PROMPT)
    assert not (await offer(nc, md, "never-prepared", hashes)).ok
    prep = PrepareRequest("s1", PROMPT, greedy(MAX_TOKENS), hashes, Pipeline.P_MD)
    assert (await request(nc, subjects.md_prepare("0"), prep, PrepareReply, timeout=WAIT_S)).ok
    got = await offer(nc, md, "s1", [12345, *hashes[:2], hashes[0]])  # one block not asked for, one twice
    assert got.ok and got.hashes == hashes[:2] and len(set(got.slots)) == 2
    assert not (await offer(nc, md, "s1", hashes[2:])).ok  # one offer per request
    assert not (await written(nc, md, "s1", [hashes[3]], [0])).ok  # not a slot it gave
    assert hashes[3] not in await cached(md)


async def test_slots_of_an_aborted_request_stay_out_of_use_until_written(services) -> None:
    md, _, nc = await services()
    hashes = md.engine.block_hashes(PROMPT)
    prep = PrepareRequest("s2", PROMPT, greedy(MAX_TOKENS), hashes, Pipeline.P_MD)
    assert (await request(nc, subjects.md_prepare("0"), prep, PrepareReply, timeout=WAIT_S)).ok
    got = await offer(nc, md, "s2", hashes)
    assert got.ok and len(got.slots) == len(hashes)
    # The anomalous-traffic filter: the relay ended the request first.
    await publish(nc, subjects.abort("s2", "relay"), Abort("s2", AbortReason.RELAY_FINISHED))
    await until(lambda: "s2" not in md.jobs, WAIT_S, 0.05)  # the drop has no event to wait on
    # A one-sided write may still be on its way: the slots stay held, nothing else is.
    assert md.engine.pool.num_free == md.engine.pool.num_blocks - len(hashes)
    assert not (await written(nc, md, "s2", hashes, [0] * len(hashes))).ok  # the request ended...
    assert md.rdma.quarantined == {}  # ...and its slots are written: free now
    assert md.engine.pool.num_free == md.engine.pool.num_blocks
