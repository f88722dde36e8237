"""The private CA: certificates that verify, keys only the owner can read, mutual TLS 1.3."""

import asyncio
import os
import ssl

import pytest

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
