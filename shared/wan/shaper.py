"""When may a chunk of one direction of a WAN link be delivered? Pure timing, no I/O.

Bandwidth is a token bucket written as a virtual clock (GCRA): each chunk of n bytes advances
the link's "busy until" time by n / rate; up to `burst_s` worth of idle credit may be saved.
Then one-way delay plus uniform jitter is added, and release times are forced monotonic: a
TCP stream is never reordered, a late chunk holds back the ones behind it (as TCP would).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# setting -> (lowest, highest, whether lowest itself is allowed). Finite and bounded, so release
# times and queue sizes stay finite numbers; a minute one way and 1 Tbit/s are past any real WAN.
LIMITS = {
    "delay_ms": (0.0, 60_000.0, True),
    "jitter_ms": (0.0, 60_000.0, True),
    "bandwidth_mbps": (0.0, 1e6, True),  # 0 and None (not checked here) both mean unlimited
}


def check_setting(name: str, value: float) -> float:
    """`value` if it is a finite number within the setting's LIMITS, else ValueError saying so."""
    low, high, low_allowed = LIMITS[name]
    above_low = value >= low if low_allowed else value > low
    if not (math.isfinite(value) and above_low and value <= high):  # NaN fails isfinite
        span = f"{'[' if low_allowed else '('}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a finite number in {span}, got {value!r}")
    return value


@dataclass
class LinkSettings:
    delay_ms: float = 0.0  # one way, per direction
    jitter_ms: float = 0.0  # uniform in [-jitter, +jitter] around delay_ms, never below 0
    bandwidth_mbps: float | None = None  # per direction; None or 0 = unlimited

    def validate(self) -> None:
        check_setting("delay_ms", self.delay_ms)
        check_setting("jitter_ms", self.jitter_ms)
        if self.bandwidth_mbps is not None:
            check_setting("bandwidth_mbps", self.bandwidth_mbps)

    @property
    def rate_bps(self) -> float | None:
        """Bytes per second, or None (no cap)."""
        return self.bandwidth_mbps * 1e6 / 8 if self.bandwidth_mbps else None


@dataclass
class Shaper:
    """One direction of one link, shared by all the link's connections (they share the pipe)."""

    settings: LinkSettings
    burst_s: float = 0.002  # idle credit the bucket may hold, in seconds of the rate
    rng: random.Random = field(default_factory=random.Random)
    _busy_until: float = 0.0  # when the virtual wire finishes the last scheduled byte

    def serialize(self, nbytes: int, now: float) -> float:
        """Time at which the last byte of the chunk has left the (virtual) sender."""
        rate = self.settings.rate_bps
        if rate is None:
            return now
        start = max(now - self.burst_s, self._busy_until)
        self._busy_until = start + nbytes / rate
        return max(now, self._busy_until)

    def propagate(self, departed: float, last_release: float) -> float:
        """Arrival time: departure + one-way delay + jitter, never before the previous chunk's."""
        s = self.settings
        d = s.delay_ms
        if s.jitter_ms:
            d = max(0.0, d + self.rng.uniform(-s.jitter_ms, s.jitter_ms))
        return max(departed + d / 1000.0, last_release)

    def chunk_size(self) -> int:
        """Read size: ~2 ms of the rate, so pacing is smooth at 10 Mbit/s and cheap at 10 Gbit/s."""
        rate = self.settings.rate_bps
        if rate is None:
            return 256 << 10
        return int(min(256 << 10, max(4 << 10, rate * 0.002)))

    def queue_limit(self) -> int:
        """Bytes a connection may hold "on the wire": at least 2x bandwidth-delay product."""
        s = self.settings
        rate = s.rate_bps
        if rate is None:
            return 32 << 20
        in_flight_s = (s.delay_ms + s.jitter_ms) / 1000.0 + 0.02
        return int(max(512 << 10, 2 * rate * in_flight_s))
