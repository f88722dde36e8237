"""`pdd serve nats --dc D --bundle DIR`: one datacenter's NATS server from its bundle.

The config is rendered at every start from what the bundle holds (the CA, the server's own
certificate, the passwords of that DC's services only) and the flags, then nats-server replaces
this process (signals reach it directly). Paths in the config are absolute, so a bundle copied
anywhere works without edits.

The gateway is the one NATS port that crosses the WAN. `--gateway-url` is what this server dials
to reach the other DC's gateway, `--advertise` what the other DC should dial to reach this one:
put both behind the WAN link (or the emulator) in front of each gateway, or gateway gossip
teaches the peer a direct address that bypasses it.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

NATS_OF = {"dc-a": "nats-a", "dc-b": "nats-b"}  # a DC's server name, also its gateway name
DEFAULT_PORTS = {"dc-a": (4222, 7222), "dc-b": (4223, 7223)}  # client, gateway


@dataclass(frozen=True)
class DcNats:
    """What one DC's server needs beyond its bundle."""

    dc: str
    listen: str  # client connections, host:port
    gateway_listen: str
    gateway_urls: tuple[str, ...]  # the other DC's gateway, as this server dials it
    advertise: str | None  # what the other DC dials to reach this gateway
    monitor: str = "127.0.0.1:8222"  # plain HTTP: keep it off the WAN


def dc_nats_config(bundle: Path, spec: DcNats) -> str:
    """The nats-server config of `spec.dc` from the bundle in `bundle`; only its users."""
    from shared.bus.nats_config import NatsConfig, NatsUser  # lazy: `pdd --help` stays quick
    from shared.bus.permissions import PERMISSIONS
    from shared.security.pki import Identity

    bundle = bundle.resolve()
    meta = json.loads((bundle / "bundle.json").read_text())
    if meta["dc"] != spec.dc:
        raise ValueError(f"{bundle} is the bundle of {meta['dc']}, not {spec.dc}")
    name = NATS_OF[spec.dc]
    users = [
        NatsUser(s, (bundle / f"{s}.nats-password").read_text().strip(), PERMISSIONS[s])
        for s in meta["services"]
    ]
    other = NATS_OF[next(d for d in NATS_OF if d != spec.dc)]
    return NatsConfig(
        name,
        spec.listen,
        spec.monitor,
        tls=Identity(bundle / "ca.pem", bundle / f"{name}.pem", bundle / f"{name}.key"),
        users=users,
        gateway_listen=spec.gateway_listen,
        gateway_advertise=spec.advertise,
        gateways={other: list(spec.gateway_urls)} if spec.gateway_urls else {},
    ).render()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdd serve nats`'s own flags (the serve parser carries them for every service)."""
    g = p.add_argument_group("nats (pdd serve nats)")
    g.add_argument("--dc", choices=sorted(NATS_OF), help="the datacenter this server belongs to")
    g.add_argument("--bundle", type=Path, help="that DC's bundle (`pdd certs bundle --dc D --out DIR`)")
    g.add_argument("--listen", help="client listener, host:port; default 0.0.0.0:4222 (dc-a), :4223 (dc-b)")
    g.add_argument("--gateway-listen", help="gateway listener; default 0.0.0.0:7222 (dc-a), :7223 (dc-b)")
    g.add_argument(
        "--gateway-url",
        action="append",
        default=[],
        help="the other DC's gateway as this server reaches it (nats://host:port; repeatable)",
    )
    g.add_argument("--advertise", help="host:port the other DC dials for this gateway (its WAN link)")
    g.add_argument(
        "--monitor", default="127.0.0.1:8222", help="monitoring HTTP listener; default: %(default)s"
    )
    g.add_argument(
        "--config-out", type=Path, help="where the rendered config goes; default: <bundle>/<server>.conf"
    )
    g.add_argument("--print-config", action="store_true", help="print the config and exit")


def serve_nats(args: argparse.Namespace) -> int:
    from shared.advertise import loopback_verdict
    from shared.bus.nats_server import nats_server_binary
    from shared.security.pki import write_private

    if not args.dc or not args.bundle:
        print("pdd serve nats: --dc and --bundle are required", flush=True)
        return 2
    client, gateway = DEFAULT_PORTS[args.dc]
    spec = DcNats(
        args.dc,
        args.listen or f"0.0.0.0:{client}",
        args.gateway_listen or f"0.0.0.0:{gateway}",
        tuple(args.gateway_url),
        args.advertise,
        args.monitor,
    )
    if spec.advertise and loopback_verdict(spec.advertise, spec.gateway_listen, False) == "refuse":
        print(
            f"pdd serve nats: --advertise {spec.advertise} is a loopback address, but the gateway "
            f"listens on {spec.gateway_listen}: the other DC would dial its own loopback",
            flush=True,
        )
        return 2
    try:
        text = dc_nats_config(args.bundle, spec)
    except (OSError, KeyError, ValueError) as e:
        print(f"pdd serve nats: {args.bundle}: {e}", flush=True)
        return 2
    if args.print_config:
        print(text, end="")
        return 0
    conf = args.config_out or args.bundle.resolve() / f"{NATS_OF[args.dc]}.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    write_private(conf, text.encode())  # it holds this DC's passwords
    binary = nats_server_binary()
    os.execv(binary, [binary, "-c", str(conf)])
    return 0  # not reached
