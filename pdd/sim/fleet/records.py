"""What a simulation reports: one record per completed request, and the run's totals."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class TokenTimes:
    """A request's tokens as the router sees them arrive, folded as they come (in order)."""

    arrival: float
    first: float = math.nan
    second: float = math.nan
    last: float = math.nan
    count: int = 0
    max_gap: float = 0.0

    def add(self, first: float, last: float, n: int, inner_gap: float) -> None:
        """n tokens: the first at `first`, the last at `last`, none further apart than inner_gap.
        The first token comes alone (prefill samples it)."""
        if n <= 0:
            return
        count, gap = self.count, self.max_gap  # (max() as comparisons: this runs per decode run and sequence)
        if count == 0:
            if n != 1:
                raise ValueError("the first token comes alone")
            self.first = first
        else:
            between = first - self.last
            if between > gap:
                gap = between
            if count == 1:
                self.second = first
        self.max_gap = inner_gap if inner_gap > gap else gap
        self.last = last
        self.count = count + n


@dataclass(slots=True)  # (tens of thousands a run: one object each, without a __dict__)
class RequestRecord:
    rid: int
    kind: str
    client: int | None
    arrival_s: float
    input_tokens: int
    output_tokens: int
    pipeline: str  # "p-md" | "p-rld-md" | "rld-only" (Pipeline values from shared.bus.messages)
    hit_rate: float  # the router's view: share of the prompt the chosen MD held
    prefill_hit: float  # share of the prompt P had cached (P computed the rest)
    ttft_s: float
    tt2t_s: float  # tt2t/tpot/max_gap: NaN with one output token
    tpot_s: float
    max_gap_s: float
    e2e_s: float  # all as seen at the router
    wan_bytes: int  # KV bytes this request put on the WAN (an aborted transfer: what was sent)
    believed_wan_bytes: int  # the router's figure for them when it routed the request
    wan_waited_blocks: int  # prompt blocks it took from another request's transfer in flight
    md_recomputed_tokens: int  # prompt tokens MD computed because their carrier dropped out
    rld_tokens: int
    md_tokens: int
    handoff_mode: str | None  # "one-shot" | "catch-up" | None
    filtered: bool  # the relay finished first and the WAN transfer was aborted
    prefill: str
    decode: str
    relay: str | None


def latencies(t: TokenTimes) -> dict[str, float]:
    """ttft, tt2t, tpot, max_gap and e2e (seconds since arrival) from a finished request's tokens."""
    several = t.count >= 2
    return {
        "ttft_s": t.first - t.arrival,
        "tt2t_s": t.second - t.arrival if several else math.nan,
        "tpot_s": (t.last - t.first) / (t.count - 1) if several else math.nan,
        "max_gap_s": t.max_gap if several else math.nan,
        "e2e_s": t.last - t.arrival,
    }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between ranks; NaN values are left out."""
    xs = [v for v in values if not math.isnan(v)]
    return float(np.percentile(xs, q)) if xs else math.nan


@dataclass
class SimResult:
    deployment: str
    workload: str
    records: list[RequestRecord]  # completed requests, by rid
    sim_time_s: float  # simulated time at the end
    wall_s: float  # real seconds simulate() took
    wan_bytes_per_s: list[float]  # bytes serialised on the WAN in each 1 s bin
    busy_s: dict[str, float] = field(default_factory=dict)  # per role: Σ instance busy seconds
    events: int = 0  # events processed
    busy_spells: dict[str, list[tuple[float, float]]] = field(
        default_factory=dict
    )  # per instance, if asked for
    refused: int = 0  # requests the router refused (429): the line could not take them in time
    held: int = 0  # requests that waited at the router for the line (refused ones included)

    def summary(self) -> dict:
        """p50/p99 of each latency; WAN Gbit/s mean and p99 (of the 1 s bins); the RLD's share
        of output tokens; the share of each pipeline; how many requests the filter ended."""
        out: dict = {"requests": len(self.records)}
        for name in ("ttft_s", "tt2t_s", "tpot_s", "max_gap_s", "e2e_s"):
            values = [getattr(r, name) for r in self.records]
            out[f"{name[:-2]}_p50_s"] = percentile(values, 50)
            out[f"{name[:-2]}_p90_s"] = percentile(values, 90)
            out[f"{name[:-2]}_p99_s"] = percentile(values, 99)
        gbit = [b * 8 / 1e9 for b in self.wan_bytes_per_s]
        out["wan_gbps_mean"] = sum(gbit) / len(gbit) if gbit else 0.0
        out["wan_gbps_p99"] = percentile(gbit, 99) if gbit else 0.0
        output = sum(r.output_tokens for r in self.records)
        out["rld_token_share"] = sum(r.rld_tokens for r in self.records) / output if output else 0.0
        n = len(self.records) or 1
        out["pipelines"] = {
            p: sum(r.pipeline == p for r in self.records) / n for p in ("p-md", "p-rld-md", "rld-only")
        }
        out["filtered"] = sum(r.filtered for r in self.records)
        out["refused"], out["held"] = self.refused, self.held
        return out
