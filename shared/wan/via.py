"""Dial on demand: a link whose target is a pattern reaches whichever allowed host:port the
client names in a first line, `PDD-VIA host:port\\n`. One emulated WAN line then serves many
receivers, even ones whose addresses are only known at run time (compose replicas).

Pure parsing and matching, no I/O: anything not plainly allowed is refused, so the emulator
never becomes an open proxy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = b"PDD-VIA "
MAX_LINE = 300  # bytes, the newline included
TIMEOUT_S = 5.0  # to receive the whole line
ANY_HOST = "*"
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")  # a name, IPv4, or [IPv6]
_PORT = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")


class ViaRefused(ValueError):
    """The client's first line does not name an allowed target."""


@dataclass(frozen=True)
class ViaPattern:
    """The targets a link may dial: `host` ("*" = any) on a port in lo..hi."""

    host: str
    lo: int
    hi: int

    def __str__(self) -> str:
        ports = str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"
        return f"{self.host}:{ports}"

    def allows(self, host: str, port: int) -> bool:
        host_ok = self.host == ANY_HOST or self.host.strip("[]").lower() == host.lower()
        return host_ok and self.lo <= port <= self.hi


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} out of range")
    return port


def parse_pattern(target: str) -> ViaPattern | None:
    """The pattern of a link target like `*:7400` or `10.0.0.5:7400-7409`; None for a plain
    `host:port` (a link that always dials that one target, no first line)."""
    host, _, ports = target.rpartition(":")
    m = _PORT.fullmatch(ports)
    if not m or not (host == ANY_HOST or _HOST.fullmatch(host)):
        raise ValueError(f"expected HOST:PORT or HOST:LO-HI (HOST may be *), got {target!r}")
    if host != ANY_HOST and m.group(2) is None:
        return None
    lo, hi = _port(m.group(1)), _port(m.group(2) or m.group(1))
    if lo > hi:
        raise ValueError(f"empty port range in {target!r}")
    return ViaPattern(host, lo, hi)


def via_line(host: str, port: int) -> bytes:
    """What a client sends first to reach host:port through a dial-on-demand link."""
    host = f"[{host}]" if ":" in host else host
    return PREFIX + f"{host}:{port}\n".encode("ascii")


def parse_via_line(line: bytes, pattern: ViaPattern) -> tuple[str, int]:
    """(host, port) that a first line (without its newline) names, if `pattern` allows it."""
    if not line.startswith(PREFIX) or len(line) >= MAX_LINE or not line.isascii():
        raise ViaRefused(f"not a PDD-VIA line: {line[:60]!r}")
    host, _, port = line[len(PREFIX) :].decode("ascii").rpartition(":")
    if not _HOST.fullmatch(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ViaRefused(f"bad target in {line[:60]!r}")
    host = host.strip("[]")
    if not pattern.allows(host, int(port)):
        raise ViaRefused(f"{host}:{port} is not in {pattern}")
    return host, int(port)
