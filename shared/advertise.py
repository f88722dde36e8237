"""The rule for every address a service gives its peers to dial (MD's bulk address, the relay's
local path, an RDMA engine's host): never a loopback address when peers outside this host are
expected, i.e. when the listener behind it is bound to a wildcard or a non-loopback address.
A host whose name resolves to 127.0.0.1 (Debian's default: 127.0.1.1) turns a wildcard bind into
such an address; a peer on another host would dial its own loopback. The service then refuses
to start (exit 2), unless the operator forces it (`advertise_loopback_ok`), which logs a warning.
Under `pdd up` everything is bound to and advertised on loopback: allowed.
"""

from __future__ import annotations

import ipaddress
import logging
import sys
from typing import Literal
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

Verdict = Literal["ok", "warn", "refuse"]
WILDCARDS = ("", "0.0.0.0", "::")


def host_of(address: str) -> str:
    """The host of `tcp://host:port`, `host:port` or a bare host; "" for a unix socket."""
    if address.startswith("unix:"):
        return ""
    if "://" in address:
        return urlsplit(address).hostname or ""
    if address.startswith("["):
        return address[1 : address.find("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def is_loopback(host: str) -> bool:
    """An IP literal in 127.0.0.0/8 or ::1, or localhost. A name is not resolved: peers
    resolve it with their own resolver."""
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_verdict(advertised: str, bound: str, loopback_ok: bool) -> Verdict:
    """refuse (or warn, when forced) when `advertised` is a loopback address while the listener
    bound at `bound` expects peers from other hosts; ok otherwise (unix sockets included)."""
    if bound.startswith("unix:") or advertised.startswith("unix:"):
        return "ok"
    if not is_loopback(host_of(advertised)):
        return "ok"
    if is_loopback(host_of(bound)):
        return "ok"  # all on this host, as under `pdd up`
    return "warn" if loopback_ok else "refuse"


def check_advertised(
    service: str, what: str, advertised: str, bound: str, loopback_ok: bool, fix: str, force: str
) -> None:
    """Apply the rule: exit 2 with a message naming `fix` (the setting that names a reachable
    address) and `force` (the one that allows loopback anyway), or warn, or nothing."""
    verdict = loopback_verdict(advertised, bound, loopback_ok)
    why = (
        f"{what} {advertised} is a loopback address, but its listener is bound to {bound}, so "
        "peers on other hosts are expected and would dial their own loopback"
    )
    if verdict == "refuse":
        print(
            f"{service}: refusing to start: {why}. Set {fix} to an address those peers reach, "
            f"or bind to loopback, or set {force}=true to advertise it anyway.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if verdict == "warn":
        log.warning("!!! %s (%s=true): only peers on this host can reach it !!!", why, force)
