"""Main decode trusts no sender's word on what KV is: a real MainDecodeService (tiny model,
real NATS, TLS bulk channel) caches only blocks it hashed itself from an announced prompt,
in the shape and dtype of its own model, from a sender holding a certificate of its CA."""

from __future__ import annotations

import pytest
import torch

from services.main_decode.service import MainDecodeService
from shared.bus import publish, request, subjects
from shared.bus.messages import Abort, AbortReason, Pipeline, PrepareReply, PrepareRequest, Role
from shared.config import EngineSettings, MainDecodeSettings, ModelSettings
from shared.engine import SamplingParams
from shared.kv import KVTransferError, open_kv_client
from shared.kv.tls import client_tls, server_tls
from shared.security import client_context
from tests.polling import until

from .test_kv_security import no_cert_context


@pytest.fixture
async def md(nats_server, nats_security):
    pki = nats_security.creds.pki  # the CA the fixtures' NATS server and services share
    ident = pki.identity("main_decode")
    nc = await nats_security.connect(nats_server, "md-trust-test")
    settings = MainDecodeSettings(
        nats_url=nats_server.url,
        instance="trust",
        bulk_address="tcp://127.0.0.1:0",
        model=ModelSettings(preset="tiny"),  # the blocks below are the tiny preset's shape
        engine=EngineSettings(kv_memory_mb=1.0),
        secret="md-trust-secret",
        tls_ca=str(ident.ca),
        tls_cert=str(ident.cert),
        tls_key=str(ident.key),
    )
    service = MainDecodeService(settings, nc)
    await service.start()
    try:
        yield service, nc, pki
    finally:
        await service.stop()
        await nc.drain()


async def prepare(nc, rid: str, prompt: list[int], hashes: list[int]) -> PrepareReply:
    msg = PrepareRequest(rid, prompt, SamplingParams(max_tokens=4), hashes, Pipeline.P_MD)
    return await request(nc, subjects.md_prepare("trust"), msg, PrepareReply, timeout=10)


async def test_md_caches_only_announced_blocks_of_prompts_it_hashed_itself(md) -> None:
    service, nc, pki = md
    engine = service.engine
    layers, two, _, *block = engine.kv_cache.shape
    dtype = engine.kv_cache.dtype

    def kv(n: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(layers, two, n, *block).to(dt)

    async def cached() -> set[int]:
        return set(await service.engine_loop.call(engine.exchange.cached_hashes))

    prompt = [(7 * i) % 200 + 1 for i in range(40)]
    hashes = engine.block_hashes(prompt)
    assert len(hashes) == 2
    client = await open_kv_client(
        service.advertise_address, "md-trust-secret", ssl=client_context(pki.identity("prefill"))
    )
    try:
        forged = [h ^ 1 for h in hashes]  # plausible hashes, not this prompt's
        reply = await prepare(nc, "forged", prompt, forged)
        assert not reply.ok and "block_hashes" in (reply.error or "") and "forged" not in service.jobs
        with pytest.raises(KVTransferError, match="unknown request"):
            await client.send_blocks("forged", forged, kv(2))
            await client.finish("forged")

        reply = await prepare(nc, "outside", prompt, hashes)
        assert reply.ok and reply.missing == hashes
        with pytest.raises(KVTransferError, match="unexpected blocks"):
            await client.send_blocks("outside", [hashes[0], 12345], kv(2))  # one block not asked for
            await client.finish("outside")

        other = torch.float16 if dtype != torch.float16 else torch.bfloat16
        assert (await prepare(nc, "layout", prompt, hashes)).ok
        with pytest.raises(KVTransferError, match="receiver's model"):
            await client.send_blocks("layout", hashes, kv(2, other))
            await client.finish("layout")
        assert await cached() == set()  # nothing of the above reached the cache

        assert (await prepare(nc, "honest", prompt, hashes)).ok
        await client.send_blocks("honest", hashes, kv(2))
        await client.finish("honest")
        assert await cached() == set(hashes)  # the same channel does carry what was asked for
    finally:
        await client.close()
    assert (await prepare(nc, "no-cert", prompt, hashes)).ok
    with pytest.raises(KVTransferError):  # and only for senders with a certificate of its CA
        c = await open_kv_client(
            service.advertise_address, "md-trust-secret", ssl=no_cert_context(pki), timeout=5
        )
        await c.send_blocks("no-cert", hashes, kv(2))
        await c.finish("no-cert", timeout=5)
    assert service.jobs["no-cert"].received == set()


@pytest.mark.parametrize("who", ["relay", "router", "main_decode"])
async def test_md_takes_kv_only_from_a_prefill_identity(md, who, caplog) -> None:
    """Another role's certificate of the same CA, holding the old shared KV key too, is refused
    right after its handshake: it hears nothing, MD's log says why."""
    service, nc, pki = md
    prompt = [(3 * i) % 200 + 1 for i in range(40)]
    hashes = service.engine.block_hashes(prompt)
    assert (await prepare(nc, "posing", prompt, hashes)).ok
    with pytest.raises(KVTransferError, match="closed the connection after the TLS handshake"):
        await open_kv_client(
            service.advertise_address, "md-trust-secret", ssl=client_context(pki.identity(who)), timeout=5
        )
    await until(lambda: f"/{who} is not prefill" in caplog.text)
    assert service.jobs["posing"].received == set()


def test_tls_settings_are_all_or_nothing(tmp_path) -> None:
    assert server_tls(MainDecodeSettings()) is None and client_tls(MainDecodeSettings()) is None
    with pytest.raises(ValueError, match="set together"):  # never a silent fallback to plaintext
        server_tls(MainDecodeSettings(tls_cert=str(tmp_path / "md.pem")))


async def test_a_prepare_overtaken_by_its_abort_takes_no_part(md) -> None:
    """The relay finished the request (its abort says so) before MD saw the prepare: MD answers
    that it takes no part, as when the abort comes during the wait for KV memory; refusing it
    would fail a request that already has all its tokens."""
    service, nc, _ = md
    prompt = [(5 * i) % 200 + 1 for i in range(40)]
    await publish(
        nc, subjects.abort("overtaken", Role.RELAY.value), Abort("overtaken", AbortReason.RELAY_FINISHED)
    )
    await until(lambda: service.was_aborted("overtaken"), 10)  # fed through NATS
    reply = await prepare(nc, "overtaken", prompt, service.engine.block_hashes(prompt))
    assert reply.ok and reply.missing == [] and reply.bulk_address == service.advertise_address, reply
    assert "overtaken" not in service.jobs
