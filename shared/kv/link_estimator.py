"""Live estimate of each peer link's goodput and round trip, from observed transfers (EWMA),
and the one formula for how long bytes take to cross a link.

Prefill keeps a LinkEstimator of its WAN peers and reports its figures in its LoadReport; the
router feeds those (bandwidth, rtt) to estimate_wan_seconds to choose a request's pipeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def estimate_wan_seconds(nbytes: int, bandwidth: float, rtt: float) -> float:
    """Time until nbytes have landed at the far end of an open connection: half an RTT of
    latency plus serialisation at `bandwidth` (bytes/s). Nothing to send still costs rtt/2."""
    if nbytes <= 0:
        return rtt / 2
    return rtt / 2 + nbytes / max(bandwidth, 1.0)


@dataclass
class _Peer:
    bandwidth: float | None = None  # bytes/s
    rtt: float | None = None  # seconds
    transfers: int = 0
    rtt_samples: int = 0
    updated: float = 0.0


class LinkEstimator:
    def __init__(
        self,
        alpha: float = 0.3,
        default_bandwidth: float = 125e6,
        default_rtt: float = 0.03,
        min_bytes: int = 64 << 10,
        forget_after_s: float = 600.0,
    ):
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.default_bandwidth = default_bandwidth
        self.default_rtt = default_rtt
        self.min_bytes = min_bytes  # smaller transfers say more about latency than bandwidth
        self.forget_after_s = forget_after_s  # peers come from NATS: keep only those still in use
        self._peers: dict[str, _Peer] = {}

    def forget_idle(self, now: float | None = None) -> None:
        """Drop peers not observed for forget_after_s (they fall back to the defaults)."""
        now = time.time() if now is None else now
        for name in [n for n, p in self._peers.items() if now - p.updated > self.forget_after_s]:
            del self._peers[name]

    def _peer(self, name: str) -> _Peer:
        self.forget_idle()
        return self._peers.setdefault(name, _Peer())

    def _ewma(self, old: float | None, sample: float) -> float:
        return sample if old is None else self.alpha * sample + (1 - self.alpha) * old

    def observe_transfer(self, peer: str, nbytes: int, seconds: float) -> None:
        """A transfer of nbytes took `seconds` from its first byte sent to the receiver's ack.
        One RTT (the ack's way back plus the last byte's way there) is taken out before
        computing the goodput sample."""
        if nbytes < self.min_bytes or seconds <= 0:
            return
        p = self._peer(peer)
        wire = max(seconds - self.rtt(peer), 0.1 * seconds)  # never trust a sub-RTT transfer fully
        p.bandwidth = self._ewma(p.bandwidth, nbytes / wire)
        p.transfers += 1
        p.updated = time.time()

    def observe_rtt(self, peer: str, seconds: float) -> None:
        if seconds <= 0:
            return
        p = self._peer(peer)
        p.rtt = self._ewma(p.rtt, seconds)
        p.rtt_samples += 1
        p.updated = time.time()

    def bandwidth(self, peer: str) -> float:
        p = self._peers.get(peer)
        return p.bandwidth if p and p.bandwidth is not None else self.default_bandwidth

    def rtt(self, peer: str) -> float:
        p = self._peers.get(peer)
        return p.rtt if p and p.rtt is not None else self.default_rtt

    def estimate_seconds(self, peer: str, nbytes: int) -> float:
        """estimate_wan_seconds with this peer's estimated goodput and round trip."""
        return estimate_wan_seconds(nbytes, self.bandwidth(peer), self.rtt(peer))

    def snapshot(self) -> dict[str, dict]:
        """{peer: {bandwidth, rtt, transfers, rtt_samples, updated}} for every peer observed
        in the last forget_after_s."""
        self.forget_idle()
        return {
            name: {
                "bandwidth": self.bandwidth(name),
                "rtt": self.rtt(name),
                "transfers": p.transfers,
                "rtt_samples": p.rtt_samples,
                "updated": p.updated,
            }
            for name, p in self._peers.items()
        }
