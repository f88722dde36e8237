"""The private CA: certificates that verify, keys only the owner can read, mutual TLS 1.3."""

import asyncio
import os
import ssl

import pytest
from cryptography.hazmat.primitives import hashes

from shared.security import Pki, client_context, server_context


def test_files_are_private_and_reused(tmp_path) -> None:
    pki = Pki(tmp_path / "pki")
    pki.ensure(["prefill", "main_decode"], ["127.0.0.1", "wan"])
    ident = pki.identity("prefill")
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in (ident.key, ident.cert, pki.dir / "ca.key"))
    before = ident.cert.read_bytes()
    pki.ensure(["prefill", "main_decode"], ["127.0.0.1", "wan"])
    assert ident.cert.read_bytes() == before  # the next start reuses them
    pki.ensure(["prefill"], ["127.0.0.1"], renew=True)
    assert ident.cert.read_bytes() != before


async def _serve(ctx: ssl.SSLContext) -> tuple[asyncio.Server, int, list[bytes]]:
    got: list[bytes] = []

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            got.append(await r.readexactly(5))
            w.write(got[-1])
            await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=ctx)
    return srv, srv.sockets[0].getsockname()[1], got


async def test_mutual_tls_13_between_identities_of_one_ca(tmp_path) -> None:
    pki = Pki(tmp_path)
    pki.ensure(["a", "b"], ["127.0.0.1"])
    srv, port, got = await _serve(server_context(pki.identity("b")))
    async with srv:
        r, w = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=client_context(pki.identity("a"))), 5
        )
        w.write(b"hello")
        assert await asyncio.wait_for(r.readexactly(5), 5) == b"hello"
        assert w.get_extra_info("ssl_object").version() == "TLSv1.3"
        w.close()


@pytest.mark.parametrize("who", ["no client certificate", "another CA"])
async def test_strangers_are_refused(tmp_path, who: str) -> None:
    pki, other = Pki(tmp_path / "ours"), Pki(tmp_path / "theirs")
    pki.ensure(["server"], ["127.0.0.1"])
    other.ensure(["client"], ["127.0.0.1"])
    if who == "no client certificate":
        ctx = ssl.create_default_context(cafile=pki.ca_cert)
    else:
        ctx = client_context(other.identity("client"))
        ctx.load_verify_locations(pki.ca_cert)  # it trusts our server, but we do not trust it
    srv, port, got = await _serve(server_context(pki.identity("server")))
    async with srv:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), 5)
            w.write(b"hello")
            assert await asyncio.wait_for(r.read(5), 5) == b""  # the server hung up
        except (ssl.SSLError, ConnectionError):
            pass
    assert got == []  # nothing reached the application


def test_more_hosts_reissue_the_leaves_from_the_same_ca(tmp_path) -> None:
    from shared.security.credentials import Credentials

    creds = Credentials(tmp_path).ensure(["prefill"], [])
    ca, leaf = creds.pki.ca_cert.read_bytes(), creds.identity("nats-a").cert.read_bytes()
    creds.ensure(["prefill"], ["new.example"])  # `pdd certs --keep --host NEW`
    assert creds.pki.ca_cert.read_bytes() == ca and creds.identity("nats-a").cert.read_bytes() != leaf
    assert creds.pki.issued(creds.identity("nats-a").cert, "spiffe://pdd/dc-a/nats/nats-a")


def test_a_ca_pem_of_two_cas_signs_with_ca_key_and_trusts_both(tmp_path) -> None:
    """A rotation's overlap: old and new CA in one ca.pem; leaves of either pass."""
    old, new = Pki(tmp_path / "old"), Pki(tmp_path / "new")
    old.ensure(["prefill"], ["127.0.0.1"])
    new.ensure(["main_decode"], ["127.0.0.1"])
    both = new.ca_cert.read_bytes() + old.ca_cert.read_bytes()
    (tmp_path / "new" / "ca.pem").write_bytes(both)
    assert new.fingerprint() == new.signer()[0].fingerprint(hashes.SHA256()).hex()
    o, n = old.identity("prefill"), new.identity("prefill")
    for src, dst in ((o.cert, n.cert), (o.key, n.key)):
        dst.write_bytes(src.read_bytes())  # a leaf of the old CA
    assert not new.issued(new.identity("prefill").cert, "spiffe://pdd/dc-a/prefill")  # not the signer's
    new.ensure(["prefill"], ["127.0.0.1"])  # so it is reissued by the new CA
    assert new.issued(new.identity("prefill").cert, "spiffe://pdd/dc-a/prefill")
    ctx = server_context(new.identity("main_decode"))
    assert len(ctx.get_ca_certs()) == 2


def test_a_leaf_without_its_identity_is_reissued(tmp_path) -> None:
    pki = Pki(tmp_path)
    pki.ensure(["relay"], ["127.0.0.1"], uri_of=lambda n: None)  # an older layout: no URI SAN
    before = pki.identity("relay").cert.read_bytes()
    pki.ensure(["relay"], ["127.0.0.1"])
    assert pki.identity("relay").cert.read_bytes() != before
    assert pki.issued(pki.identity("relay").cert, "spiffe://pdd/dc-a/relay")
