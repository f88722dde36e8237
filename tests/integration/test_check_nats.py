"""`pdd check` against a real gatewayed NATS pair, from a bundle directory per DC (laid out as
`pdd certs bundle` writes it): everything ok in dc-a and dc-b while the other DC's peers run,
and a FAIL (exit 1) for an MD bulk address that nobody listens on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from shared.bus import subjects
from shared.bus.connection import publish
from shared.bus.messages import LoadReport, Role
from shared.config import ENV_PREFIX
from shared.ports import free_port
from shared.security.credentials import Credentials
from shared.security.pki import server_context, write_private
from shared.serving.runtime import Lifecycle
from shared.telemetry.span_bus import serve_traces
from tests.fixtures_nats import NatsSecurity

IDENTITIES = {
    "router": "dc-a/router",
    "prefill": "dc-a/prefill",
    "relay": "dc-a/relay",
    "main_decode": "dc-b/main_decode",
    "nats-a": "dc-a/nats/nats-a",
    "nats-b": "dc-b/nats/nats-b",
}


def _with_identity(creds: Credentials, name: str, uri: str) -> None:
    """Reissue `name`'s certificate from the same CA with a URI SAN naming its identity."""
    ca_key = serialization.load_pem_private_key((creds.dir / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate(creds.identity(name).ca.read_bytes())
    ident = creds.identity(name)
    old = x509.load_pem_x509_certificate(ident.cert.read_bytes())
    names = old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    key = serialization.load_pem_private_key(ident.key.read_bytes(), None)
    usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    cert = (
        x509.CertificateBuilder()
        .subject_name(old.subject)
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(old.not_valid_before_utc)
        .not_valid_after(old.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([*names, x509.UniformResourceIdentifier(uri)]), critical=False
        )
        .add_extension(usage, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_private(ident.cert, cert.public_bytes(serialization.Encoding.PEM))


def _bundle(out: Path, creds: Credentials, dc: str, services: list[str], nats_url: str) -> Path:
    """A DC's bundle: ca.pem, <svc>.pem/.key/.env (relative paths), bundle.json."""
    out.mkdir(mode=0o700)
    shutil.copy(creds.identity("router").ca, out / "ca.pem")
    for svc in services:
        ident, p = creds.identity(svc), ENV_PREFIX[svc]
        shutil.copy(ident.cert, out / f"{svc}.pem")
        shutil.copy(ident.key, out / f"{svc}.key")
        env = {
            f"{p}TLS_CA": "ca.pem",
            f"{p}TLS_CERT": f"{svc}.pem",
            f"{p}TLS_KEY": f"{svc}.key",
            f"{p}DATACENTER": dc,
            f"{p}NATS_URL": nats_url,
        }
        (out / f"{svc}.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    meta = {"dc": dc, "services": services, "nats": f"nats-{dc[-1]}", "hosts": [], "ca_fingerprint": ""}
    (out / "bundle.json").write_text(json.dumps(meta))
    return out


async def _check(*args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdd.cli",
        "check",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode()


async def test_pdd_check_in_both_datacenters(tmp_path: Path) -> None:
    sec = NatsSecurity.create(tmp_path / "ca")
    for name, ident in IDENTITIES.items():
        _with_identity(sec.creds, name, f"spiffe://pdd/{ident}")
    gw_b = free_port()
    b = sec.server("dc-b", "nats-b", gateway_port=gw_b)
    a = sec.server("dc-a", gateway_port=free_port(), gateways={"dc-b": f"nats://127.0.0.1:{gw_b}"})
    await b.start()
    await a.start()
    kv = await asyncio.start_server(
        lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_context(sec.creds.identity("main_decode"))
    )
    bulk = f"tcp://127.0.0.1:{kv.sockets[0].getsockname()[1]}"
    md = await sec.connect(b, "md", user="main_decode")
    router = await sec.connect(a, "router", user="router")
    life = Lifecycle()

    async def beats() -> None:  # what each DC's services publish every 0.5 s
        while True:
            await publish(
                md, subjects.load("main_decode", "0"), LoadReport(Role.MAIN_DECODE, "0", address=bulk)
            )
            await publish(router, subjects.load("router", "r0"), LoadReport(Role.ROUTER, "r0"))
            await asyncio.sleep(0.3)

    beating = asyncio.create_task(beats())
    try:
        await a.wait_gateways(15)
        await b.wait_gateways(15, names=["dc-a"])
        await serve_traces(life, md, Role.MAIN_DECODE, "0", "dc-b", tmp_path / "no-spans")
        bundle_a = _bundle(tmp_path / "a", sec.creds, "dc-a", ["prefill", "relay", "router"], a.url)
        bundle_b = _bundle(tmp_path / "b", sec.creds, "dc-b", ["main_decode"], b.url)

        gateway = f"nats://127.0.0.1:{gw_b}"
        code, out = await _check(
            "--bundle", str(bundle_a), "--monitor", a.monitor_url, "--gateway-url", gateway
        )
        assert code == 0, out
        lines = out.splitlines()[1:]
        # MD's learned address is loopback here: it answers, but only from MD's own host.
        assert [line[:4].strip() for line in lines] == ["ok"] * 6 + ["warn", "ok"], out
        checks = ["own cert (router)", f"server cert {a.url}", f"gateway cert {gateway}", "nats"]
        checks += ["gateway (from dc-b)"]
        checks += ["gateway (/gatewayz)", f"md bulk {bulk}", "clock vs dc-b"]
        assert [line[6:].split("  ")[0].strip() for line in lines] == checks, out
        assert "heard main_decode/0" in out and "PDD_MD_ADVERTISE" in out, out

        code, out = await _check("--bundle", str(bundle_b))
        assert code == 0, out
        assert "heard router/r0" in out and "skip  md bulk" in out and "skip  clock vs dc-a" in out, out
        assert "FAIL" not in out and "warn" not in out, out

        closed = f"tcp://127.0.0.1:{free_port()}"
        code, out = await _check("--bundle", str(bundle_a), "--md-bulk", closed)
        assert code == 1 and f"FAIL  md bulk {closed}" in out, out
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await life.close()
        await md.close()
        await router.close()
        kv.close()
        await a.stop()
        await b.stop()
