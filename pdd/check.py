"""`pdd check`: the preflight of one host of a datacenter, with that host's own credentials.

Credentials come from a bundle directory (`pdd certs bundle`: bundle.json, <svc>.env and the
files it names) or from env files (KEY=VALUE, as `pdd serve --env-file` reads them). One line
per check, ok / warn / FAIL (skip: the check does not apply in this DC); exit 1 on any FAIL.

    own cert      valid now, not expiring within 30 days, its URI SAN names this role and DC
    server cert   each NATS URL in use: the server's certificate names that host, role nats
    gateway cert  the same for each --gateway-url (the other DC's gateway this DC's server dials)
    nats          connect with this service's certificate (the server maps it to the role's
                  user), then flush
    gateway       a load report from the other DC heard through the gateway (and, with
                  --monitor, the server's /gatewayz lists an inbound and an outbound gateway)
    md bulk       dc-a: each MD address (--md-bulk, else learned from MD's load reports)
                  takes a TCP connection and a TLS handshake, and its certificate names the host
    clock         dc-a, as router: the other DC's engine instances answer pdd.traces.<dc>.get
                  with their clock; warn past 100 ms (a trace across DCs assumes NTP)

The verdicts are pure functions of what was observed (tested on their own); the probes only
gather the facts.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import ssl
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509

from pdd.launch import other_dc
from shared.config import ENV_PREFIX, SETTINGS
from shared.env_file import parse_env_file
from shared.security.identity import PeerIdentity, mismatch
from shared.security.identity import parse_identity as identity_of

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
EXPIRY_WARN_DAYS = 30
CLOCK_WARN_S = 0.1
HEAR_S = 1.5  # load reports go out every 0.5 s: three chances to hear each instance
SPIFFE_PREFIX = "spiffe://pdd/"
DEFAULT_SERVICE = {"dc-a": "router", "dc-b": "main_decode"}  # the roles that hear the other DC


@dataclass(frozen=True)
class Verdict:
    status: str  # OK | WARN | FAIL | SKIP
    check: str
    reason: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.check:<24}  {self.reason}"


def exit_code(verdicts: Iterable[Verdict]) -> int:
    return 1 if any(v.status == FAIL for v in verdicts) else 0


# ---- verdicts (pure) ---------------------------------------------------------------------------


def parse_identity(uris: Iterable[str]) -> PeerIdentity | None:
    """The first well-formed pdd identity among a certificate's URIs."""
    for uri in uris:
        with contextlib.suppress(ValueError):
            return identity_of(uri)
    return None


def names_host(host: str, dns: Iterable[str], ips: Iterable[str]) -> bool:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host.lower().rstrip(".") in {d.lower() for d in dns}
    return any(ipaddress.ip_address(i) == addr for i in ips)


def own_cert_verdict(
    not_before: dt.datetime,
    not_after: dt.datetime,
    uris: Sequence[str],
    role: str,
    dc: str,
    now: dt.datetime,
) -> Verdict:
    check = f"own cert ({role})"
    ident = parse_identity(uris)
    if now < not_before:
        return Verdict(FAIL, check, f"not valid before {not_before:%Y-%m-%d %H:%M} UTC (this host's clock?)")
    if now >= not_after:
        return Verdict(FAIL, check, f"expired {not_after:%Y-%m-%d}: reissue it (pdd certs bundle)")
    if ident is None:
        return Verdict(
            FAIL, check, f"names no {SPIFFE_PREFIX}<dc>/<role> identity: reissue it (pdd certs bundle)"
        )
    if why := mismatch(ident, role, dc):
        return Verdict(FAIL, check, f"{why}: {ident.uri} cannot run {role} in {dc}")
    left = not_after - now
    if left < dt.timedelta(days=EXPIRY_WARN_DAYS):
        return Verdict(WARN, check, f"expires in {left.days} days ({not_after:%Y-%m-%d}): rotate it")
    return Verdict(OK, check, f"{SPIFFE_PREFIX}{'/'.join(filter(None, ident))}, {left.days} days left")


def peer_cert_verdict(
    check: str, host: str, dns: Sequence[str], ips: Sequence[str], uris: Sequence[str], role: str
) -> Verdict:
    """The certificate a server at `host` presented has role `role` and names the host. Who
    it is comes first: another role's certificate is that fault, whatever hosts it names."""
    ident = parse_identity(uris)
    if ident is None:
        return Verdict(FAIL, check, f"its certificate names no {SPIFFE_PREFIX}<dc>/{role} identity")
    if why := mismatch(ident, role):
        return Verdict(FAIL, check, f"{why}: {host} presents {ident.uri}")
    if not names_host(host, dns, ips):
        return Verdict(
            FAIL,
            check,
            f"its certificate names {sorted({*dns, *ips})}, not {host}: add it (pdd certs add-host)",
        )
    return Verdict(OK, check, f"names {host}, {SPIFFE_PREFIX}{'/'.join(filter(None, ident))}")


def gatewayz_verdict(gatewayz: dict[str, Any]) -> Verdict:
    """The monitoring endpoint's view: a gateway out to the other DC and one in from it."""
    out = sorted(gatewayz.get("outbound_gateways") or {})
    inb = sorted(gatewayz.get("inbound_gateways") or {})
    if not out or not inb:
        return Verdict(FAIL, "gateway (/gatewayz)", f"outbound {out or 'none'}, inbound {inb or 'none'}")
    return Verdict(OK, "gateway (/gatewayz)", f"outbound {out}, inbound {inb}")


def heard_verdict(other_dc: str, subjects: Sequence[str], heard: Sequence[str], window_s: float) -> Verdict:
    """Load reports from the other DC: proof that its server is reached through the gateway."""
    check = f"gateway (from {other_dc})"
    if not subjects:
        return Verdict(
            WARN, check, f"this service may not hear {other_dc}'s reports: run with --service router"
        )
    if not heard:
        return Verdict(
            FAIL,
            check,
            f"no load report on {', '.join(subjects)} in {window_s:g} s: gateway down, or nothing runs in {other_dc}",
        )
    return Verdict(OK, check, f"heard {', '.join(sorted(heard))}")


def local_only(address: str) -> str | None:
    """Why an address MD advertises cannot be dialed from another host (loopback, wildcard)."""
    host = urlsplit(address).hostname or ""
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host)
        if ip.is_loopback or ip.is_unspecified:
            return f"MD advertises {host}: only its own host can dial it (set PDD_MD_ADVERTISE)"
    if host == "localhost":
        return "MD advertises localhost: only its own host can dial it (set PDD_MD_ADVERTISE)"
    return None


def bulk_verdict(probe: Verdict, note: str | None) -> Verdict:
    """A learned MD address that only MD's host can dial is a warning even where it answers here."""
    if note is None:
        return probe
    return Verdict(WARN if probe.status == OK else probe.status, probe.check, f"{probe.reason}; {note}")


def clock_verdict(
    other_dc: str, samples: Sequence[tuple[str, float, float]], limit_s: float = CLOCK_WARN_S
) -> Verdict:
    """samples: (who, offset of its clock from ours in s, round trip in s). The sample with the
    shortest round trip bounds the offset best (to ± half of it)."""
    check = f"clock vs {other_dc}"
    if not samples:
        return Verdict(WARN, check, f"no {other_dc} instance answered: clocks not compared")
    who, offset, rtt = min(samples, key=lambda s: s[2])
    told = f"{who} {offset * 1e3:+.1f} ms (± {rtt * 500:.1f} ms)"
    if abs(offset) - rtt / 2 > limit_s:
        return Verdict(WARN, check, f"{told}: beyond {limit_s * 1e3:g} ms, run NTP on both DCs' hosts")
    return Verdict(OK, check, told)


# ---- credentials -------------------------------------------------------------------------------


def service_of(env: dict[str, str]) -> str | None:
    """The service whose certificate the env names (PDD_<SERVICE>_TLS_CERT)."""
    return next((name for name, p in ENV_PREFIX.items() if f"{p}TLS_CERT" in env), None)


def bundle_env(directory: Path, service: str | None) -> tuple[str, dict[str, str]]:
    """(service, its env) from a bundle: bundle.json says the DC and its services."""
    meta = json.loads((directory / "bundle.json").read_text())
    services = list(meta.get("services") or [])
    chosen = service or DEFAULT_SERVICE.get(meta.get("dc", ""))
    if chosen not in services:
        chosen = service or (services[0] if services else None)
    if not chosen or not (directory / f"{chosen}.env").exists():
        raise SystemExit(f"pdd check: no {chosen or 'service'}.env in {directory} (services: {services})")
    env = parse_env_file(directory / f"{chosen}.env")
    env.setdefault(f"{ENV_PREFIX[chosen]}DATACENTER", meta.get("dc", ""))
    return chosen, env


def load_settings(service: str, env: dict[str, str]) -> Any:
    """The service's settings from the files' values under the process environment (which wins)."""
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return SETTINGS[service]()


# ---- probes ------------------------------------------------------------------------------------


def _names(cert: x509.Certificate) -> tuple[list[str], list[str], list[str]]:
    """(DNS names, IP addresses, URIs) of a certificate's subject alternative names."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], [], []
    ips = [str(i) for i in san.get_values_for_type(x509.IPAddress)]
    return san.get_values_for_type(x509.DNSName), ips, san.get_values_for_type(x509.UniformResourceIdentifier)


def _verifying_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    """Our client certificate, the server's chain checked against our CA; its name we check ourselves."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.check_hostname = False
    return ctx


def own_cert(settings: Any, role: str) -> Verdict:
    try:
        cert = x509.load_pem_x509_certificate(Path(settings.tls_cert).read_bytes())
    except (OSError, ValueError) as e:
        return Verdict(FAIL, f"own cert ({role})", f"{settings.tls_cert}: {e}")
    now = dt.datetime.now(dt.UTC)
    uris = _names(cert)[2]
    return own_cert_verdict(
        cert.not_valid_before_utc, cert.not_valid_after_utc, uris, role, settings.datacenter, now
    )


async def _peer_cert(host: str, port: int, ctx: ssl.SSLContext, info_first: bool, timeout_s: float) -> bytes:
    """The DER certificate a server presents. NATS's client port speaks first (INFO, in the
    clear), then upgrades to TLS; its gateway port and the bulk channel are TLS from the first byte."""
    async with asyncio.timeout(timeout_s):
        if not info_first:
            _, writer = await asyncio.open_connection(host, port, ssl=ctx, server_hostname=host)
        else:
            reader, writer = await asyncio.open_connection(host, port)
            if not (await reader.readline()).startswith(b"INFO"):
                writer.close()
                raise ConnectionError("not a NATS server (no INFO)")
            await writer.start_tls(ctx, server_hostname=host)
        try:
            return writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        finally:
            writer.close()


async def peer_cert(
    check: str, address: str, ctx: ssl.SSLContext, role: str, info_first: bool, timeout_s: float
) -> Verdict:
    url = urlsplit(address)
    host, port = url.hostname or "", url.port or 4222
    try:
        der = await _peer_cert(host, port, ctx, info_first, timeout_s)
    except ssl.SSLCertVerificationError as e:
        return Verdict(FAIL, check, f"its certificate is not from our CA: {e.verify_message}")
    except (OSError, TimeoutError, ssl.SSLError) as e:
        return Verdict(FAIL, check, f"{host}:{port}: {type(e).__name__}: {e or 'timed out'}")
    dns, ips, uris = _names(x509.load_der_x509_certificate(der))
    return peer_cert_verdict(check, host, dns, ips, uris, role)


async def hear_other_dc(
    nc, service: str, other_dc: str, window_s: float
) -> tuple[list[str], list[str], list[str]]:
    """(subjects listened to, "<role>/<instance>" heard, MD bulk addresses reported) from the
    load reports of the roles that run in the other DC."""
    from pdd.launch import SERVICES, datacenter
    from shared.bus.codec import MessageError, decode
    from shared.bus.messages import LoadReport, Role
    from shared.bus.permissions import PERMISSIONS, allows, own_load

    wanted = [own_load(r) for r in SERVICES if datacenter(r) == other_dc]
    allowed = [s for s in wanted if allows(PERMISSIONS[service].subscribe, s)]
    heard: set[str] = set()
    addresses: set[str] = set()

    async def on(raw) -> None:
        with contextlib.suppress(MessageError):
            r = decode(LoadReport, raw.data)
            heard.add(f"{r.service}/{r.instance}")
            if r.service is Role.MAIN_DECODE and r.address:
                addresses.add(r.address)

    subs = [await nc.subscribe(s, cb=on) for s in allowed]
    await asyncio.sleep(window_s if allowed else 0)
    for sub in subs:
        await sub.unsubscribe()
    return allowed, sorted(heard), sorted(addresses)


async def clock_samples(nc, other_dc: str, timeout_s: float, n: int = 3) -> list[tuple[str, float, float]]:
    """(who, its clock minus ours in s, round trip in s) per answer to a trace query for nothing."""
    from shared.bus import subjects
    from shared.bus.connection import request
    from shared.bus.messages import TraceQuery, TraceSpans

    out = []
    for _ in range(n):
        t0 = time.time_ns()
        try:
            r = await request(
                nc,
                subjects.traces_get(other_dc),
                TraceQuery(trace_id="0" * 32),
                TraceSpans,
                timeout=timeout_s,
            )
        except Exception:  # no responder, timeout, permission: nothing to compare
            break
        t1 = time.time_ns()
        out.append((f"{r.service}/{r.instance}", (r.now_ns - (t0 + t1) / 2) / 1e9, (t1 - t0) / 1e9))
    return out


async def run_checks(
    service: str,
    settings: Any,
    *,
    md_bulk: Sequence[str] = (),
    bulk_identity: tuple[str, str, str] | None = None,
    gateway_urls: Sequence[str] = (),
    monitor: str | None = None,
    timeout_s: float = 3.0,
) -> list[Verdict]:
    """Every check, in order; a check that cannot run for want of an earlier one says why."""
    from shared.bus.connection import connect
    from shared.security.credentials import nats_options

    urls = [u.strip() for u in settings.nats_url.split(",") if u.strip()]
    needed = ("tls_ca", "tls_cert", "tls_key")
    missing = [n for n in needed if not getattr(settings, n)]
    if missing:
        why = f"{service}: no {', '.join(missing)} in the bundle, env files or environment"
        return [Verdict(FAIL, "credentials", why)]
    try:
        ctx = _verifying_context(settings.tls_ca, settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as e:
        return [Verdict(FAIL, "credentials", f"{service}'s TLS files: {e}")]
    out = [own_cert(settings, service)]
    for url in urls:
        out.append(await peer_cert(f"server cert {url}", url, ctx, "nats", True, timeout_s))
    for url in gateway_urls:  # the other DC's gateway, as this DC's server dials it
        out.append(await peer_cert(f"gateway cert {url}", url, ctx, "nats", False, timeout_s))

    nc = None
    try:
        t0 = time.monotonic()
        opts = nats_options(settings)
        nc = await connect(urls, f"pdd-check-{service}", timeout=timeout_s, allow_reconnect=False, **opts)
        await nc.flush(timeout_s)
        took = (time.monotonic() - t0) * 1e3
        out.append(Verdict(OK, "nats", f"{nc.connected_url.netloc} as {service}, {took:.0f} ms"))
    except Exception as e:
        why = str(e) or f"no connection within {timeout_s:g} s"
        out.append(Verdict(FAIL, "nats", f"{', '.join(urls)} as {service}: {type(e).__name__}: {why}"))
    try:
        out += await _bus_checks(nc, service, settings, md_bulk, bulk_identity, monitor, timeout_s)
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
    return out


async def _bus_checks(
    nc,
    service: str,
    settings: Any,
    md_bulk: Sequence[str],
    bulk_identity: tuple[str, str, str] | None,
    monitor: str | None,
    timeout_s: float,
) -> list[Verdict]:
    """gateway, md bulk, clock: what the other DC shows of itself on the bus."""
    import httpx

    from shared.bus.permissions import PERMISSIONS, allows
    from shared.bus.subjects import traces_get

    dc = settings.datacenter
    other = other_dc(dc)
    out: list[Verdict] = []
    learned: list[str] = []
    if nc is None:
        out.append(Verdict(FAIL, f"gateway (from {other})", "no NATS connection"))
    else:
        window = min(HEAR_S, timeout_s)
        subs, heard, learned = await hear_other_dc(nc, service, other, window)
        out.append(heard_verdict(other, subs, heard, window))
    if monitor:
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as http:
                out.append(gatewayz_verdict((await http.get(f"{monitor.rstrip('/')}/gatewayz")).json()))
        except (httpx.HTTPError, ValueError) as e:
            out.append(Verdict(FAIL, "gateway (/gatewayz)", f"{monitor}: {type(e).__name__}: {e}"))

    if dc != "dc-a":
        out.append(Verdict(SKIP, "md bulk", "MD's address must be reachable from dc-a: run pdd check there"))
    else:
        addresses = list(md_bulk) or learned
        if not addresses:
            out.append(Verdict(FAIL, "md bulk", "no --md-bulk given and no MD load report heard"))
        files = bulk_identity or (settings.tls_ca, settings.tls_cert, settings.tls_key)
        bulk_ctx = _verifying_context(*files)
        for address in addresses:
            probe = await peer_cert(f"md bulk {address}", address, bulk_ctx, "main_decode", False, timeout_s)
            out.append(bulk_verdict(probe, None if md_bulk else local_only(address)))

    clock = f"clock vs {other}"
    if nc is None:
        out.append(Verdict(WARN, clock, "no NATS connection: clocks not compared"))
    elif not allows(PERMISSIONS[service].publish, traces_get(other)):
        out.append(Verdict(SKIP, clock, "asked from dc-a as router (a trace across DCs assumes NTP)"))
    else:
        out.append(clock_verdict(other, await clock_samples(nc, other, timeout_s)))
    return out


def main(args: Any) -> int:
    """`pdd check` with the parsed arguments (pdd/cli.py)."""
    env: dict[str, str] = {}
    service, bulk_identity = args.service, None
    if args.bundle:
        service, env = bundle_env(args.bundle, args.service)
        prefill = [args.bundle / f for f in ("ca.pem", "prefill.pem", "prefill.key")]
        if all(p.exists() for p in prefill):  # prefill is who dials MD's bulk address
            bulk_identity = tuple(map(str, prefill))
    for f in args.env_file:
        env.update(parse_env_file(f))
    service = service or service_of(env)
    if not service:
        raise SystemExit(
            "pdd check: which service? give --service, --bundle or an env file naming PDD_<SVC>_TLS_CERT"
        )
    if args.nats_url:
        os.environ[f"{ENV_PREFIX[service]}NATS_URL"] = args.nats_url
    settings = load_settings(service, env)
    logging.getLogger("shared.bus.connection").setLevel(logging.ERROR)  # the verdicts say it once
    logging.getLogger("asyncio").setLevel(logging.ERROR)  # a NATS socket closed right after its TLS upgrade
    verdicts = asyncio.run(
        run_checks(
            service,
            settings,
            md_bulk=args.md_bulk,
            bulk_identity=bulk_identity,
            gateway_urls=args.gateway_url,
            monitor=args.monitor,
            timeout_s=args.timeout,
        )
    )
    print(f"pdd check: {service} in {settings.datacenter}")
    for v in verdicts:
        print(v.line())
    return exit_code(verdicts)
