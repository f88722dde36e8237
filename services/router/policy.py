"""Routing policy: which pipeline and which instances serve a request. Pure functions."""

from __future__ import annotations

from dataclasses import dataclass

from shared.bus.messages import Pipeline, Role
from shared.kv.link_estimator import estimate_wan_seconds


@dataclass(frozen=True)
class RouteDecision:
    pipeline: Pipeline
    hit_rate: float  # fraction of prompt tokens whose KV MD already holds
    missing_bytes: int  # KV bytes that must cross the WAN
    est_wan_s: float  # estimated time for them to cross


def choose_pipeline(
    prompt_tokens: int,
    cached_tokens: int,
    kv_bytes_per_token: int,
    bandwidth: float,
    rtt: float,
    threshold_s: float,
    relay_available: bool,
    backlog_bytes: int = 0,
) -> RouteDecision:
    """P→MD when the missing KV crosses the WAN fast enough, else P→RLD→MD.

    KV already queued toward MD (`backlog_bytes`) shares the link, so a request that has
    blocks to send counts it too (conservatively, as if it went first).
    P→RLD alone is not an option: finishing requests locally would let MD's cache fall
    behind P's and push ever more traffic onto the relay.
    """
    cached_tokens = max(0, min(cached_tokens, prompt_tokens))
    missing_bytes = (prompt_tokens - cached_tokens) * kv_bytes_per_token
    on_wire = missing_bytes + backlog_bytes if missing_bytes else 0
    est = estimate_wan_seconds(on_wire, bandwidth, rtt)
    hit_rate = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    pipeline = Pipeline.P_RLD_MD if est > threshold_s and relay_available else Pipeline.P_MD
    return RouteDecision(pipeline, hit_rate, missing_bytes, est)


@dataclass(frozen=True)
class InstanceLoad:
    instance: str
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0


def choose_main_decode(candidates: list[InstanceLoad], cached_blocks: dict[str, int]) -> str | None:
    """The MD holding the longest cached prefix; ties go to the least loaded."""
    if not candidates:
        return None
    best = max(
        candidates,
        key=lambda c: (cached_blocks.get(c.instance, 0), -(c.running + c.waiting), c.free_blocks),
    )
    return best.instance


def choose_least_loaded(candidates: list[InstanceLoad]) -> str | None:
    if not candidates:
        return None
    return min(candidates, key=lambda c: (c.running + c.waiting, -c.free_blocks, c.instance)).instance


def resume_candidates(
    mds: list[InstanceLoad], relays: list[InstanceLoad], cached_blocks: dict[str, int]
) -> list[tuple[Role, str]]:
    """Where a request whose instance was lost may continue, best first: the MDs (decode is
    their job) by longest cached prefix, then least loaded; then the relays by load (an
    RLD-only finish, the fault fallback)."""
    by_md = sorted(mds, key=lambda c: (-cached_blocks.get(c.instance, 0), c.running + c.waiting, -c.free_blocks))
    by_relay = sorted(relays, key=lambda c: (c.running + c.waiting, -c.free_blocks, c.instance))
    return [(Role.MAIN_DECODE, c.instance) for c in by_md] + [(Role.RELAY, c.instance) for c in by_relay]
