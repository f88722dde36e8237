"""A DC's NATS server from its bundle alone: its own services log in, and nothing in DC B's
bundle logs in as any DC A service (the certificate is the user: nats-a has none for MD's)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import nats
import pytest

from pdd.certs import DC_SERVICES, bundle_nats_config, write_bundle
from shared.bus.nats_server import nats_server_binary
from shared.ports import free_port
from shared.security import Identity, client_context
from shared.security.pki import write_private


@pytest.fixture
async def nats_a(tmp_path):
    bundles = {dc: write_bundle(tmp_path / "w", dc, tmp_path / dc) for dc in ("dc-a", "dc-b")}
    port = free_port()
    conf = bundle_nats_config(
        bundles["dc-a"], f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}", monitor=f"127.0.0.1:{free_port()}"
    )
    write_private(tmp_path / "nats-a.conf", conf.encode())
    proc = await asyncio.create_subprocess_exec(
        nats_server_binary(),
        "-c",
        str(tmp_path / "nats-a.conf"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", port)
                    w.close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
        yield f"tls://127.0.0.1:{port}", bundles
    finally:
        proc.terminate()
        await proc.wait()


async def login(url: str, bundle: Path, cert: str, **claim: str):
    """Connect with `cert`'s certificate from `bundle`; `claim`: a user and password it names too."""
    tls = client_context(Identity(bundle / "ca.pem", bundle / f"{cert}.pem", bundle / f"{cert}.key"))

    async def quiet(_e: Exception) -> None:
        pass

    return await nats.connect(
        url,
        tls=tls,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        connect_timeout=3,
        error_cb=quiet,
        **claim,
    )


async def test_dc_b_bundle_cannot_log_in_as_a_dc_a_service(nats_a) -> None:
    url, bundles = nats_a
    for service in DC_SERVICES["dc-a"]:  # each DC A service logs in with its own certificate alone
        nc = await login(url, bundles["dc-a"], service)
        await nc.close()
    b = bundles["dc-b"]
    assert not list(b.glob("*password*")) and not list(bundles["dc-a"].glob("*password*"))
    # all DC B holds is MD's certificate: nats-a has no user for it, whatever it claims
    for claim in [{}, *({"user": s, "password": "x"} for s in [*DC_SERVICES["dc-a"], "main_decode"])]:
        with pytest.raises(Exception, match="(?i)authorization"):
            nc = await login(url, b, "main_decode", **claim)
            await nc.close()
