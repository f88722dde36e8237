"""`pdd certs bundle | add-host | add-instance`: one datacenter's credentials, from the CA of
a workdir, for that DC's hosts only.

A bundle directory (0700, files 0600) holds what a DC's hosts need and nothing of the other
DC's: the CA certificate (never its key), the DC's NATS server certificate and config (only
its own services' users, each mapped from its certificate), each of its services' certificate
and key (no NATS password: the certificate is the credential), dc-a's local KV key, an env file per service (`pdd serve SERVICE --env-file`, paths relative to the
bundle) and bundle.json. Certificates are issued from <workdir>/secrets/ca.key; nothing
already issued (in the workdir or the other DC's bundle) changes.

    ca.pem  nats-a.{pem,key,conf}  <svc>.{pem,key,env}  [kv-local-secret]  bundle.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from pdd.launch import DC_A, DC_B, NATS_CLUSTER, SERVICES, UpOptions, datacenter, other_dc
from shared.config import ENV_PREFIX
from shared.security.credentials import LOCAL_HOSTS, LOCAL_KV_SERVICES, LOCAL_SECRET, Credentials
from shared.security.identity import PeerIdentity, parse_identity
from shared.security.pki import Identity, write_private

DCS = (DC_A, DC_B)
DC_SERVICES = {dc: tuple(s for s in SERVICES if datacenter(s) == dc) for dc in DCS}
NATS_OF = NATS_CLUSTER  # a DC's server name, also its gateway name
_UP = UpOptions()  # `pdd up`'s ports are a bundle's defaults too: client, gateway
NATS_PORTS = {DC_A: (_UP.nats_a_port, _UP.gw_a_port), DC_B: (_UP.nats_b_port, _UP.gw_b_port)}
MONITOR = "127.0.0.1:8222"  # plain HTTP: keep it off the WAN
ENV_KEY = re.compile(r"[A-Z_][A-Z0-9_]*")


def _secrets(workdir: Path) -> Credentials:
    """The workdir's credentials: the CA and the local key (made if missing)."""
    return Credentials(workdir.resolve() / "secrets").ensure(SERVICES, [])


def _record(creds: Credentials, dc: str) -> Path:
    """Where the workdir remembers a DC's bundle (its directory and hosts), for add-host."""
    return creds.dir / f"bundle-{dc}.json"


def _issue(creds: Credentials, out: Path, stem: str, name: str, hosts: list[str], uri: str) -> None:
    creds.pki.issue(out / f"{stem}.pem", out / f"{stem}.key", name, hosts, uri)


def _hosts(hosts: list[str]) -> list[str]:
    """What a bundle's certificates name besides their own name: where its peers dial them
    (clients and the other DC's gateway check the NATS server's; `pdd check` MD's)."""
    return sorted({*LOCAL_HOSTS, *hosts})


def _issue_dc(creds: Credentials, out: Path, dc: str, hosts: list[str]) -> None:
    """The DC's role-wide certificates: its NATS server's and each of its services'."""
    nats = NATS_OF[dc]
    _issue(creds, out, nats, nats, _hosts(hosts), PeerIdentity(dc, "nats", nats).uri)
    for service in DC_SERVICES[dc]:
        _issue(creds, out, service, service, _hosts(hosts), PeerIdentity(dc, service).uri)


def _copy(src: Path, dst: Path) -> None:
    write_private(dst, src.read_bytes())


def _service_env(dc: str, service: str, stem: str, extra: dict[str, str]) -> dict[str, str]:
    """A service's env file: its NATS user, the paths of its files (relative to the bundle)."""
    p = ENV_PREFIX[service]
    env = {
        f"{p}DATACENTER": dc,
        f"{p}TLS_CA": "ca.pem",
        f"{p}TLS_CERT": f"{stem}.pem",
        f"{p}TLS_KEY": f"{stem}.key",
    }
    if service in LOCAL_KV_SERVICES:
        env[f"{p}SECRET_FILE"] = LOCAL_SECRET
    return {**env, **extra}


def _write_env(path: Path, env: dict[str, str]) -> None:
    text = "# pdd serve SERVICE --env-file FILE; relative paths are the bundle's files\n"
    write_private(path, (text + "".join(f"{k}={v}\n" for k, v in env.items())).encode())


def _service_files(creds: Credentials, out: Path, dc: str, service: str, extra: dict[str, str]) -> None:
    if service in LOCAL_KV_SERVICES:
        _copy(creds.secret_file, out / creds.secret_file.name)
    _write_env(out / f"{service}.env", _service_env(dc, service, service, extra))


def parse_env(pairs: list[str]) -> dict[str, str]:
    """--env KEY=VALUE, each checked (a stray newline would add a setting)."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not ENV_KEY.fullmatch(key) or "\n" in value:
            raise ValueError(f"--env {pair!r}: expected KEY=VALUE (KEY in A-Z, 0-9, _)")
        env[key] = value
    return env


def _private_dir(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    return out


def write_bundle(
    workdir: Path, dc: str, out: Path, hosts: list[str] | None = None, env: dict[str, str] | None = None
) -> Path:
    """Issue dc's certificates from the workdir's CA into `out` and write the rest of its
    bundle (see the module's docstring); returns `out`."""
    if dc not in DCS:
        raise ValueError(f"unknown datacenter {dc!r} (one of {', '.join(DCS)})")
    creds, out, hosts = _secrets(workdir), _private_dir(out.resolve()), sorted(set(hosts or []))
    _copy(creds.pki.ca_cert, out / "ca.pem")  # every CA it holds (a rotation's overlap): never the key
    for old in out.glob("*.nats-password"):  # a bundle made before certificates were the NATS credential
        old.unlink()
    _issue_dc(creds, out, dc, hosts)
    for service in DC_SERVICES[dc]:
        _service_files(creds, out, dc, service, env or {})
    meta = {
        "dc": dc,
        "services": list(DC_SERVICES[dc]),
        "nats": NATS_OF[dc],
        "hosts": hosts,
        "ca_fingerprint": creds.pki.fingerprint(),
    }
    write_private(out / "bundle.json", (json.dumps(meta, indent=2) + "\n").encode())
    write_private(out / f"{NATS_OF[dc]}.conf", bundle_nats_config(out).encode())
    write_private(_record(creds, dc), json.dumps({"out": str(out), "hosts": hosts}).encode())
    return out


def bundle_nats_config(
    bundle_dir: Path,
    listen: str | None = None,
    gateway_listen: str | None = None,
    gateway_urls: list[str] | tuple[str, ...] = (),
    advertise: str | None = None,
    monitor: str = MONITOR,
) -> str:
    """The nats-server config of a bundle's DC, with the bundle's absolute paths and only the
    users of its own services. listen / gateway_listen default to 0.0.0.0 on the DC's ports
    (nats-a 4222 / 7222, nats-b 4223 / 7223); gateway_urls: how this server dials the other
    DC's gateway (none: it waits to be dialed); advertise: the address the other DC should dial
    (the WAN link in front of this gateway)."""
    from shared.bus.nats_config import NatsConfig, nats_users  # lazy: shared.bus pulls in nats

    bundle_dir = Path(bundle_dir).resolve()
    meta = json.loads((bundle_dir / "bundle.json").read_text())
    dc, nats = meta["dc"], meta["nats"]
    users = nats_users(meta["services"])
    client_port, gateway_port = NATS_PORTS[dc]
    tls = Identity(bundle_dir / "ca.pem", bundle_dir / f"{nats}.pem", bundle_dir / f"{nats}.key")
    return NatsConfig(
        nats,
        listen or f"0.0.0.0:{client_port}",
        monitor,
        tls=tls,
        users=users,
        gateway_listen=gateway_listen or f"0.0.0.0:{gateway_port}",
        gateway_advertise=advertise,
        gateways={NATS_OF[other_dc(dc)]: list(gateway_urls)} if gateway_urls else {},
    ).render()


def add_host(workdir: Path, dc: str, host: str, out: Path | None = None) -> Path:
    """Reissue the role-wide certificates of dc's bundle (default: where `bundle` last wrote
    it) naming `host` too, from the same CA; nothing else changes (an instance's certificate
    names its own hosts). Returns the bundle."""
    creds = _secrets(workdir)
    record = json.loads(_record(creds, dc).read_text()) if _record(creds, dc).exists() else {}
    out = (out or Path(record.get("out", ""))).resolve()
    meta_file = out / "bundle.json"
    if not meta_file.exists() or json.loads(meta_file.read_text())["dc"] != dc:
        raise ValueError(f"{out} is no bundle of {dc} (`pdd certs bundle --dc {dc} --out DIR` first)")
    meta = json.loads(meta_file.read_text())
    meta["hosts"] = sorted({*meta["hosts"], host})
    _issue_dc(creds, out, dc, meta["hosts"])
    write_private(meta_file, (json.dumps(meta, indent=2) + "\n").encode())
    write_private(_record(creds, dc), json.dumps({"out": str(out), "hosts": meta["hosts"]}).encode())
    return out


def add_instance(
    workdir: Path, dc: str, role: str, instance: str, out: Path, hosts: list[str] | None = None
) -> Path:
    """One instance's own certificate (spiffe://pdd/<dc>/<role>/<instance>) into `out`, as
    <role>-<instance>.pem/.key, with what it needs to run there (the CA certificate, its
    role's local KV key where it has one, an env file) unless present; returns the certificate."""
    if role != "nats" and role not in DC_SERVICES.get(dc, ()):
        raise ValueError(f"{role} does not run in {dc} (it has {', '.join(DC_SERVICES.get(dc, ()))}, nats)")
    ident = parse_identity(PeerIdentity(dc, role, instance).uri)  # a well-formed instance id
    creds, out = _secrets(workdir), _private_dir(out.resolve())
    stem = f"{role}-{instance}"
    _issue(creds, out, stem, role, _hosts(hosts or []), ident.uri)
    if not (out / "ca.pem").exists():
        _copy(creds.pki.ca_cert, out / "ca.pem")
    if role != "nats":
        if role in LOCAL_KV_SERVICES and not (out / creds.secret_file.name).exists():
            _copy(creds.secret_file, out / creds.secret_file.name)
        extra = {f"{ENV_PREFIX[role]}INSTANCE": instance}
        _write_env(out / f"{stem}.env", _service_env(dc, role, stem, extra))
    return out / f"{stem}.pem"


def add_subcommands(certs: argparse.ArgumentParser) -> None:
    """`pdd certs bundle | add-host | add-instance`; without one, `pdd certs` does as before."""
    sub = certs.add_subparsers(dest="certs_command", metavar="{bundle,add-host,add-instance}")
    workdir = {"type": Path, "default": UpOptions().workdir, "help": "whose secrets/ca.key issues them"}
    b = sub.add_parser("bundle", help="one datacenter's credentials and NATS config, for its hosts")
    b.add_argument("--dc", choices=DCS, required=True)
    b.add_argument("--out", type=Path, required=True, help="the bundle directory (created 0700)")
    b.add_argument("--workdir", **workdir)
    b.add_argument(
        "--host", action="append", default=[], help="a name the DC's servers are dialed by (NATS, MD's KV)"
    )
    b.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="one more line of every env file"
    )
    h = sub.add_parser("add-host", help="reissue a bundle's certificates naming one more host")
    h.add_argument("--dc", choices=DCS, required=True)
    h.add_argument("--host", required=True)
    h.add_argument("--out", type=Path, default=None, help="the bundle (default: where `bundle` wrote it)")
    h.add_argument("--workdir", **workdir)
    i = sub.add_parser("add-instance", help="one instance's own certificate (and env file) into DIR")
    i.add_argument("--dc", choices=DCS, required=True)
    i.add_argument("--role", required=True, choices=("prefill", "relay", "router", "main_decode", "nats"))
    i.add_argument("--instance", required=True)
    i.add_argument("--host", action="append", default=[], help="a name the instance is dialed by")
    i.add_argument("--out", type=Path, required=True)
    i.add_argument("--workdir", **workdir)


def run(args: Any) -> int:
    """Run the subcommand `add_subcommands` parsed; 2 on a refusal, with why."""
    try:
        if args.certs_command == "bundle":
            out = write_bundle(args.workdir, args.dc, args.out, args.host, parse_env(args.env))
            print(f"pdd certs: {args.dc} bundle in {out} (copy it to {args.dc}'s hosts only)")
        elif args.certs_command == "add-host":
            out = add_host(args.workdir, args.dc, args.host, args.out)
            print(
                f"pdd certs: {args.dc}'s certificates in {out} name {args.host} too (copy them to its hosts)"
            )
        else:
            cert = add_instance(args.workdir, args.dc, args.role, args.instance, args.out, args.host)
            print(f"pdd certs: {cert} for {args.role} instance {args.instance} of {args.dc}")
    except (ValueError, OSError) as e:
        print(f"pdd certs {args.certs_command}: {e}", file=sys.stderr)
        return 2
    return 0
