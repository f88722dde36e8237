"""`pdd wan` / `python -m shared.wan`: run WAN links as a TCP proxy with a control API."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from shared.wan.emulator import WanEmulator
from shared.wan.link import WanLink
from shared.wan.shaper import check_setting

EPILOG = """\
link syntax:  NAME=LISTEN>TARGET[,delay_ms=X][,jitter_ms=X][,bandwidth_mbps=X]
  LISTEN and TARGET are host:port; quote the argument in a shell because of '>'.
  A TARGET pattern HOST:LO-HI or *:PORT[-HI] dials on demand: each client first sends one
  line "PDD-VIA host:port\\n" naming a target the pattern allows (else it is refused).
  Per-link options override the global --delay-ms/--jitter-ms/--bandwidth-mbps.
  Delay is one-way per direction: a round trip adds 2 x delay. Bandwidth is per direction.

example:
  python -m shared.wan --control 127.0.0.1:7490 \\
      --link 'bulk=127.0.0.1:7401>127.0.0.1:7400' \\
      --link 'gw-ab=127.0.0.1:7501>127.0.0.1:7500,bandwidth_mbps=100' \\
      --link 'bulk-many=127.0.0.1:7402>127.0.0.1:7410-7419' \\
      --delay-ms 15 --jitter-ms 2 --bandwidth-mbps 1000

control API:
  curl 127.0.0.1:7490/links
  curl -XPOST 127.0.0.1:7490/links/bulk -H 'content-type: application/json' \\
      -d '{"delay_ms": 40, "bandwidth_mbps": 100}'      # or {"cut": true, "cut_mode": "blackhole"}, {"cut": false}
"""


UNLIMITED = ("none", "unlimited", "inf", "0", "0.0")  # what --bandwidth-mbps accepts for no cap


class _BadValue(argparse.ArgumentTypeError, ValueError):
    """argparse prints its message; parse_link's callers catch it as a ValueError."""


def _setting(name: str) -> Callable[[str], float | None]:
    """Parser of one link setting given as text, within the range the control API accepts."""

    def parse(value: str) -> float | None:
        if name == "bandwidth_mbps" and value.strip().lower() in UNLIMITED:
            return None
        try:
            return check_setting(name, float(value))
        except ValueError as e:  # from float() (not a number) or check_setting (out of range)
            raise _BadValue(f"bad {name} {value!r}: {e}") from None

    return parse


_OPTS = {name: _setting(name) for name in ("delay_ms", "jitter_ms", "bandwidth_mbps")}


def parse_link(spec: str, defaults: dict) -> WanLink:
    name, eq, rest = spec.partition("=")
    route, *opts = rest.split(",")
    listen, gt, target = route.partition(">")
    if not (name and eq and gt):
        raise ValueError(f"bad --link {spec!r}: expected NAME=LISTEN>TARGET")
    kw = dict(defaults)
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in _OPTS:
            raise ValueError(f"bad --link option {key!r} (allowed: {', '.join(_OPTS)})")
        kw[key] = _OPTS[key](value)
    return WanLink(name, listen.removesuffix("-").strip(), target.strip(), **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdd wan",
        description="User-space WAN emulator: TCP proxy links with one-way delay, jitter, "
        "bandwidth cap (token bucket) and cut/restore, controlled over HTTP.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--control", default="127.0.0.1:7490", help="host:port of the control API (default %(default)s)"
    )
    p.add_argument(
        "--link", action="append", default=[], metavar="SPEC", help="a link, repeatable (see below)"
    )
    delay, jitter = _OPTS["delay_ms"], _OPTS["jitter_ms"]
    p.add_argument("--delay-ms", type=delay, default=0.0, help="one-way delay per direction")
    p.add_argument("--jitter-ms", type=jitter, default=0.0, help="uniform jitter +-ms on the delay")
    p.add_argument(
        "--bandwidth-mbps",
        type=_OPTS["bandwidth_mbps"],
        default=None,
        help="cap per direction; none/0 = unlimited (default)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


async def _run(emu: WanEmulator) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await emu.start()
    print(f"wan control: {emu.control_url}", flush=True)
    for link in emu.links.values():
        print(f"wan link {link.name}: {link.listen} > {link.target} {link.state()}", flush=True)
    try:
        await stop.wait()
    finally:
        await emu.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    defaults = {"delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms, "bandwidth_mbps": args.bandwidth_mbps}
    try:
        links = [parse_link(spec, defaults) for spec in args.link]
    except ValueError as e:
        parser.error(str(e))
    if not links:
        parser.error("at least one --link is required")
    asyncio.run(_run(WanEmulator(links, control=args.control)))
    return 0
