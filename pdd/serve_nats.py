"""`pdd serve nats --dc D --bundle DIR`: one datacenter's NATS server from its bundle.

The config is rendered at every start from what the bundle holds (the CA, the server's own
certificate, the users of that DC's services only, each mapped from its certificate) and the flags, then nats-server replaces
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
from pathlib import Path

from pdd.certs import NATS_OF, NATS_PORTS


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
    from pdd.certs import bundle_nats_config
    from shared.advertise import loopback_verdict
    from shared.bus.nats_server import nats_server_binary
    from shared.security.pki import write_private

    if not args.dc or not args.bundle:
        print("pdd serve nats: --dc and --bundle are required", flush=True)
        return 2
    gateway_listen = args.gateway_listen or f"0.0.0.0:{NATS_PORTS[args.dc][1]}"
    if args.advertise and loopback_verdict(args.advertise, gateway_listen, False) == "refuse":
        print(
            f"pdd serve nats: --advertise {args.advertise} is a loopback address, but the gateway "
            f"listens on {gateway_listen}: the other DC would dial its own loopback",
            flush=True,
        )
        return 2
    try:
        if (dc := json.loads((args.bundle / "bundle.json").read_text())["dc"]) != args.dc:
            raise ValueError(f"it is the bundle of {dc}, not {args.dc}")
        text = bundle_nats_config(
            args.bundle, args.listen, gateway_listen, args.gateway_url, args.advertise, args.monitor
        )
    except (OSError, KeyError, ValueError) as e:
        print(f"pdd serve nats: {args.bundle}: {e}", flush=True)
        return 2
    if args.print_config:
        print(text, end="")
        return 0
    conf = args.config_out or args.bundle.resolve() / f"{NATS_OF[args.dc]}.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    write_private(conf, text.encode())
    binary = nats_server_binary()
    os.execv(binary, [binary, "-c", str(conf)])
    return 0  # not reached
