"""The KV bulk channel checks who is at the other end by the role its certificate names, over
real TLS sockets with the certificates `pdd certs bundle` issues: prefill streams only to a
main_decode identity, a receiver takes KV only from prefill's, and DC B's bundle holds nothing
that passes for a DC A service. The local unix:// path keeps a key only dc-a holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
from pathlib import Path

import pytest
import torch

from pdd.certs import write_bundle
from services.prefill.service import PrefillService
from shared.config import PrefillSettings
from shared.kv import KVClientPool, KVTransferError, open_kv_client, start_kv_server
from shared.security import Identity, client_context, server_context
from shared.serving.engine_service import KV_SENDERS
from tests.engine_util import make_engine
from tests.polling import until

from .test_kv_channel import MemorySink, blocks

MD_ONLY = ("main_decode",)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bundles")
    return {dc: write_bundle(root / "w", dc, root / dc) for dc in ("dc-a", "dc-b")}


def ident(bundles, dc: str, name: str) -> Identity:
    b = bundles[dc]
    return Identity(b / "ca.pem", b / f"{name}.pem", b / f"{name}.key")


def prefill_tls(bundles):
    """prefill's side as the service builds it: its certificate, the role checked, not a host name."""
    return client_context(ident(bundles, "dc-a", "prefill"), check_hostname=False)


async def md_receiver(bundles, name: str = "main_decode", dc: str = "dc-b", secret: str | None = None):
    """A receiver as main decode runs it (no KV key; senders by identity), with `name`'s certificate."""
    sink = MemorySink()
    ssl = server_context(ident(bundles, dc, name))
    return await start_kv_server("tcp://127.0.0.1:0", secret, sink, ssl=ssl, peer_roles=KV_SENDERS), sink


def untouched(sink: MemorySink) -> bool:
    return not sink.held and not sink.done and not sink.aborts and not sink.groups


async def test_prefill_streams_to_main_decode_by_identity_alone(bundles) -> None:
    server, sink = await md_receiver(bundles)
    pool = KVClientPool(None, ssl=prefill_tls(bundles), peer_roles=MD_ONLY)
    try:
        client = await pool.acquire(server.address)
        await client.send_blocks("r1", [1, 2], src := blocks(2))
        await client.finish("r1", payload=b"ok")
        assert torch.equal(sink.tensor("r1"), src) and sink.done == {"r1": b"ok"}
        assert list(server.in_flight) and all(
            "spiffe://pdd/dc-a/prefill@" in r.identity for r in server._receivers
        )
    finally:
        await pool.close()
        await server.close()


@pytest.mark.parametrize("dc, name", [("dc-a", "relay"), ("dc-a", "router"), ("dc-a", "nats-a")])
async def test_another_roles_certificate_posing_as_main_decode_gets_no_kv(bundles, dc, name) -> None:
    """A dc-a host's credentials, listening where prefill was told MD is: prefill refuses it
    before sending a byte, whatever key the impostor holds."""
    impostor, sink = await md_receiver(bundles, name, dc, secret="whatever-it-knows")
    pool = KVClientPool("kv-local-key", ssl=prefill_tls(bundles), peer_roles=MD_ONLY)
    try:
        with pytest.raises(KVTransferError, match=rf"peer identity spiffe://pdd/{dc}/\S+ is not main_decode"):
            await pool.acquire(impostor.address)
        await until(lambda: impostor.in_flight == {})  # it saw us hang up, having got nothing
        assert untouched(sink)
    finally:
        await pool.close()
        await impostor.close()


@pytest.mark.parametrize(
    "dc, name", [("dc-a", "relay"), ("dc-a", "router"), ("dc-b", "main_decode"), ("dc-b", "nats-b")]
)
async def test_another_roles_certificate_posing_as_prefill_is_refused_by_main_decode(
    bundles, dc, name, caplog
) -> None:
    """Refused right after the TLS handshake, before the receiver sends anything (no banner, no
    key share): the sender only sees the connection close; MD's log says why, as a warning."""
    refused: list = []
    sink = MemorySink()
    ssl = server_context(ident(bundles, "dc-b", "main_decode"))
    server = await start_kv_server(
        "tcp://127.0.0.1:0", None, sink, ssl=ssl, peer_roles=KV_SENDERS,
        on_refused=lambda peer, e: refused.append(e),
    )  # fmt: skip
    tls = client_context(ident(bundles, dc, name), check_hostname=False)
    try:
        with caplog.at_level(logging.INFO, logger="shared.kv"):
            with pytest.raises(KVTransferError, match="closed the connection after the TLS handshake"):
                client = await open_kv_client(server.address, None, ssl=tls, timeout=5)
                await client.send_blocks("r1", [1], blocks(1))
                await client.finish("r1", timeout=5)
            await until(lambda: bool(refused))
        (e,) = refused  # the service hears of it (and tells the router)
        assert e.identity.startswith(f"spiffe://pdd/{dc}/") and e.reason.endswith("is not prefill")
        (rec,) = [r for r in caplog.records if "is not prefill" in r.getMessage()]
        assert rec.levelno == logging.WARNING and untouched(sink) and server.in_flight == {}
    finally:
        await server.close()


async def _raw_tls(address: str, ctx: ssl_module.SSLContext, *, hang_up: bool) -> bytes:
    """A bare TLS client (as `openssl s_client` with a certificate is): all the server sends
    it within 2 s of the handshake, or nothing at all when it hangs up at once (a probe)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx, server_hostname=host)
    got = b""
    if not hang_up:
        with contextlib.suppress(TimeoutError, ConnectionError, ssl_module.SSLError):
            async with asyncio.timeout(2):
                while chunk := await reader.read(1 << 16):
                    got += chunk
    writer.close()
    with contextlib.suppress(ConnectionError, ssl_module.SSLError):
        await writer.wait_closed()
    return got


async def test_a_bare_tls_client_of_another_role_hears_nothing(bundles, caplog) -> None:
    server, sink = await md_receiver(bundles)
    relay = client_context(ident(bundles, "dc-a", "relay"), check_hostname=False)
    try:
        with caplog.at_level(logging.INFO, logger="shared.kv"):
            assert await _raw_tls(server.address, relay, hang_up=False) == b""  # no banner, no share
            await until(lambda: "is not prefill" in caplog.text)
        assert untouched(sink)
    finally:
        await server.close()


@pytest.mark.parametrize("name", ["prefill", "router"])
async def test_a_probe_that_hangs_up_after_the_handshake_is_no_warning(bundles, caplog, name) -> None:
    """`pdd check` from DC A: a TLS handshake with prefill's certificate (or another DC A
    role's), then it hangs up. MD's log notes it at info, not as an attack."""
    server, sink = await md_receiver(bundles)
    ctx = client_context(ident(bundles, "dc-a", name), check_hostname=False)
    try:
        with caplog.at_level(logging.INFO, logger="shared.kv"):
            await _raw_tls(server.address, ctx, hang_up=True)
            await until(lambda: "refused" in caplog.text or "gone" in caplog.text or "probe" in caplog.text)
            await asyncio.sleep(0.2)
        kv = [r for r in caplog.records if r.name.startswith("shared.kv")]
        assert kv and all(r.levelno <= logging.INFO for r in kv), [(r.levelname, r.getMessage()) for r in kv]
        assert untouched(sink)
    finally:
        await server.close()


async def test_a_certificate_of_another_ca_or_expired_is_refused_by_name(bundles, tmp_path, caplog) -> None:
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    from shared.security import Pki

    foreign = Pki(tmp_path / "foreign")
    foreign.ensure(["prefill"], ["127.0.0.1"])  # a prefill identity from another CA
    a = bundles["dc-a"]
    # An expired prefill certificate from our CA: reissued with a validity in the past.
    w = bundles["dc-a"].parent / "w" / "secrets"
    pki = Pki(w)
    signer, signer_key = pki.signer()
    leaf = x509.load_pem_x509_certificate((a / "prefill.pem").read_bytes())
    now = datetime.now(UTC)
    old = (
        x509.CertificateBuilder(signer.subject, leaf.subject, leaf.public_key(), x509.random_serial_number(),
                                now - timedelta(days=10), now - timedelta(days=1), list(leaf.extensions))
        .sign(signer_key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "expired.pem").write_bytes(old.public_bytes(serialization.Encoding.PEM))
    expired = Identity(a / "ca.pem", tmp_path / "expired.pem", a / "prefill.key")
    server, sink = await md_receiver(bundles)
    try:
        with caplog.at_level(logging.INFO, logger="shared.kv"):
            for ident_, why in (
                (foreign.identity("prefill"), "unknown CA"),
                (expired, "expired certificate"),
            ):
                ctx = client_context(Identity(a / "ca.pem", ident_.cert, ident_.key), check_hostname=False)
                with pytest.raises(KVTransferError):
                    await open_kv_client(server.address, None, ssl=ctx, timeout=5)
                await until(lambda why=why: why in caplog.text)
                (rec,) = [r for r in caplog.records if why in r.getMessage()]
                assert rec.levelno == logging.WARNING
        assert untouched(sink)
    finally:
        await server.close()


async def test_dc_b_bundle_holds_no_kv_key_and_nothing_of_dc_a(bundles) -> None:
    b = bundles["dc-b"]
    assert not list(b.glob("kv-*")) and not list(b.glob("prefill*")) and not list(b.glob("relay*"))
    assert "SECRET" not in (b / "main_decode.env").read_text()
    local_key = (bundles["dc-a"] / "kv-local-secret").read_text()
    assert all(local_key not in f.read_text() for f in b.iterdir())


async def test_local_path_goes_by_the_dc_a_key(bundles, tmp_path) -> None:
    """prefill -> relay over unix://: no TLS there, so the HMAC key of dc-a's bundle; a sender
    without it (MD's bundle has none) is refused."""
    key = (bundles["dc-a"] / "kv-local-secret").read_text().strip()
    sink = MemorySink()
    relay = await start_kv_server(f"unix://{tmp_path}/relay.sock", key, sink, peer_roles=KV_SENDERS)
    pool = KVClientPool(key, ssl=prefill_tls(bundles), peer_roles=MD_ONLY)  # prefill's one pool
    try:
        client = await pool.acquire(relay.address)
        await client.send_blocks("r1", [1], src := blocks(1))
        await client.finish("r1")
        assert torch.equal(sink.tensor("r1"), src)
        with pytest.raises(KVTransferError, match="holds none"):
            await open_kv_client(relay.address, None, timeout=5)
        with pytest.raises(KVTransferError, match="authentication failed"):
            await open_kv_client(relay.address, "not-the-key", timeout=5)
    finally:
        await pool.close()
        await relay.close()


async def test_a_receiver_that_cannot_authenticate_senders_does_not_start(bundles, tmp_path) -> None:
    with pytest.raises(ValueError, match="no secret"):  # plaintext and no key
        await start_kv_server("tcp://127.0.0.1:0", None, MemorySink(), peer_roles=KV_SENDERS)
    with pytest.raises(ValueError, match="no secret"):  # unix:// has no certificates to check
        ssl = server_context(ident(bundles, "dc-b", "main_decode"))
        await start_kv_server(f"unix://{tmp_path}/x.sock", None, MemorySink(), ssl=ssl, peer_roles=KV_SENDERS)


async def prefill_service(bundles, nats_server, nats_security) -> PrefillService:
    """A real PrefillService with dc-a's prefill certificate (its KV pools are what is tested)."""
    a = bundles["dc-a"]
    files = {
        "tls_ca": str(a / "ca.pem"),
        "tls_cert": str(a / "prefill.pem"),
        "tls_key": str(a / "prefill.key"),
    }
    nc = await nats_security.connect(nats_server, "prefill-identity")
    try:
        return PrefillService(PrefillSettings(secret="k", instance="0", **files), nc, make_engine())
    finally:
        await nc.close()


async def test_the_prefill_service_streams_to_md_and_refuses_a_relay_posing_as_it(
    bundles, nats_server, nats_security
) -> None:
    pool = (await prefill_service(bundles, nats_server, nats_security)).kv_clients
    impostor, lost = await md_receiver(bundles, "relay", "dc-a")
    md, sink = await md_receiver(bundles)
    try:
        with pytest.raises(KVTransferError, match="spiffe://pdd/dc-a/relay is not main_decode"):
            await pool.acquire(impostor.address)
        client = await pool.acquire(md.address)  # at an address its certificate does not name
        await client.send_blocks("r1", [1], blocks(1))
        await client.finish("r1")
        assert "r1" in sink.done and untouched(lost)
    finally:
        await pool.close()
        await impostor.close()
        await md.close()


async def test_a_ca_rotation_overlaps_so_old_and_new_leaves_meet(tmp_path) -> None:
    """docs/security.md's procedure: trust both CAs everywhere, reissue, then drop the old."""
    from shared.security.credentials import Credentials

    w = tmp_path / "w"
    old_b = write_bundle(w, "dc-b", tmp_path / "b")  # MD keeps its old-CA leaf throughout
    new = Credentials(tmp_path / "new" / "secrets").ensure([], [])
    both = new.pki.ca_cert.read_bytes() + (w / "secrets" / "ca.pem").read_bytes()
    (old_b / "ca.pem").write_bytes(both)  # 1. trust both (MD restarted with it)
    (w / "secrets" / "ca.pem").write_bytes(both)  # 2. reissue dc-a from the new CA
    (w / "secrets" / "ca.key").write_bytes(new.pki.ca_key.read_bytes())
    new_a = write_bundle(w, "dc-a", tmp_path / "a")
    assert (new_a / "ca.pem").read_bytes() == both
    bundles = {"dc-a": new_a, "dc-b": old_b}
    server, sink = await md_receiver(bundles)
    pool = KVClientPool(None, ssl=prefill_tls(bundles), peer_roles=MD_ONLY)
    try:
        client = await pool.acquire(server.address)  # new leaf to old leaf, both ways trusted
        await client.send_blocks("r1", [1], blocks(1))
        await client.finish("r1")
        assert "r1" in sink.done
    finally:
        await pool.close()
        await server.close()
    (old_b / "ca.pem").write_bytes((tmp_path / "new" / "secrets" / "ca.pem").read_bytes())  # 3. drop old
    server, _ = await md_receiver(bundles)  # ...too early: MD's own leaf is still the old CA's
    pool = KVClientPool(None, ssl=prefill_tls(bundles), peer_roles=MD_ONLY)
    try:
        (new_a / "ca.pem").write_bytes(new.pki.ca_cert.read_bytes())
        pool.ssl = prefill_tls(bundles)  # prefill, done with step 3, no longer trusts MD's old leaf
        with pytest.raises(KVTransferError, match="certificate verify failed"):
            await pool.acquire(server.address)
    finally:
        await pool.close()
        await server.close()


async def test_an_instance_identity_is_its_role(bundles, tmp_path, caplog) -> None:
    """`pdd certs add-instance`: spiffe://pdd/dc-a/prefill/p-2 sends like prefill; a relay
    instance's certificate is still no prefill."""
    from pdd.certs import add_instance

    w = bundles["dc-a"].parent / "w"
    for role, instance in (("prefill", "p-2"), ("relay", "r-2")):
        add_instance(w, "dc-a", role, instance, tmp_path)
    server, sink = await md_receiver(bundles)
    try:
        tls = client_context(
            Identity(tmp_path / "ca.pem", tmp_path / "prefill-p-2.pem", tmp_path / "prefill-p-2.key"), False
        )
        client = await open_kv_client(server.address, None, ssl=tls, peer_roles=MD_ONLY)
        await client.send_blocks("r1", [1], blocks(1))
        await client.finish("r1")
        await client.close()
        assert "r1" in sink.done
        tls = client_context(
            Identity(tmp_path / "ca.pem", tmp_path / "relay-r-2.pem", tmp_path / "relay-r-2.key"), False
        )
        with caplog.at_level(logging.WARNING, logger="shared.kv"):
            with pytest.raises(KVTransferError, match="closed the connection after the TLS handshake"):
                await open_kv_client(server.address, None, ssl=tls, peer_roles=MD_ONLY, timeout=5)
            await until(lambda: "spiffe://pdd/dc-a/relay/r-2 is not prefill" in caplog.text)
        assert list(sink.done) == ["r1"]
    finally:
        await server.close()


async def test_the_prefill_service_takes_a_relay_on_tcp_only_for_the_local_path(
    bundles, nats_server, nats_security
) -> None:
    """A relay on another dc-a host (tcp://, PDD_RELAY_ADVERTISE): the local path accepts its
    certificate, the WAN path never; and a main decoder does not pass for a relay."""
    service = await prefill_service(bundles, nats_server, nats_security)
    relay, sink = await md_receiver(bundles, "relay", "dc-a")  # a receiver as the relay runs it
    md, lost = await md_receiver(bundles)
    try:
        client = await service.local_clients.acquire(relay.address)
        await client.send_blocks("r1", [1], blocks(1))
        await client.finish("r1")
        assert "r1" in sink.done
        with pytest.raises(KVTransferError, match="spiffe://pdd/dc-a/relay is not main_decode"):
            await service.kv_clients.acquire(relay.address)
        with pytest.raises(KVTransferError, match="spiffe://pdd/dc-b/main_decode is not relay"):
            await service.local_clients.acquire(md.address)
        assert untouched(lost)
        # the relay's blocks (no `missing`) take the local pool, a main decoder's the WAN one
        assert service.senders.open(relay.address, "r2").pool is service.local_clients
        assert service.senders.open(md.address, "r3", []).pool is service.kv_clients
    finally:
        await service.kv_clients.close()
        await service.local_clients.close()
        await relay.close()
        await md.close()
