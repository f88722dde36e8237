"""One request's state across the fleet while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.sim.fleet.decoder import DecodeInstance, Seq
from pdd.sim.fleet.instance import Blocks
from pdd.sim.fleet.link import Transfer
from pdd.sim.fleet.prefill import PrefillInstance
from pdd.sim.fleet.records import RequestRecord, TokenTimes, latencies
from pdd.sim.workloads.workload import SimRequest
from shared.bus.messages import HandoffMode, Pipeline


@dataclass(eq=False)
class Job:
    req: SimRequest
    times: TokenTimes
    pipeline: Pipeline
    hit_rate: float
    prefill: PrefillInstance
    md: DecodeInstance
    relay: DecodeInstance | None
    md_delay_s: float  # MD's tokens reach the router this much later
    assigned: list[tuple[tuple[str, str], float]] = field(default_factory=list)  # for Assignments.finished
    prefill_hit: float = 0.0
    prefill_admitted: bool = False
    # KV toward MD (and the relay)
    kv_upto: int = 0  # prompt tokens whose KV exists at P
    prefill_done: bool = False
    md_hit_tokens: int | None = None  # known to P once MD's prepare reply is back
    wan_sent_upto: int = 0
    local_sent_upto: int = 0
    wan_transfers: list[Transfer] = field(default_factory=list)
    md_blocks: Blocks | None = None
    md_seq: Seq | None = None
    md_extending: int = 0  # handoff batches MD has not finished extending
    md_dropped: bool = False
    # prompt blocks shared in flight on MD (pdd/sim/fleet/sharing.py; off: all stay empty)
    md_key: str = ""  # the request's id in MD's BlocksInFlight, once it claimed its blocks
    md_carry: list[int] = field(default_factory=list)  # block indices it carries, not landed yet
    md_waited: list[int] = field(default_factory=list)  # block indices another transfer carries
    md_lost: set[int] = field(default_factory=set)  # waited block hashes whose carrier dropped out
    md_landed_upto: int = 0  # prompt tokens of its own transfer landed on MD
    md_marker_landed: bool = False
    md_started: bool = False
    md_recomputed_tokens: int = 0  # lost blocks' tokens MD computed itself
    believed_wan_bytes: int = 0  # the router's figure of the KV this request puts on the WAN
    # the relay
    rld_blocks: Blocks | None = None
    rld_seq: Seq | None = None
    md_ready: bool = False  # MD's kv_ready reached the relay
    handing: bool = False  # the handoff started (and the relay still holds the request)
    handed_over: bool = False
    mode: HandoffMode | None = None
    handed: int = 0  # output tokens sent to MD
    rounds: int = 0  # catch-up batches sent before the final one
    filtered: bool = False
    done: bool = False

    def first_out(self, at: float) -> None:
        """The first token (the one P sampled) reaches the router at `at`, unless it did."""
        if self.times.count == 0:
            self.times.add(at, at, 1, 0.0)

    @property
    def relay_holds(self) -> bool:
        """The relay may still end the request (before the final batch left)."""
        return self.relay is not None and not self.handed_over

    @property
    def wan_bytes(self) -> int:
        return sum(t.sent for t in self.wan_transfers)

    def record(self) -> RequestRecord:
        r = self.req
        pipeline = Pipeline.RLD_ONLY if self.filtered else self.pipeline
        return RequestRecord(
            rid=r.rid,
            kind=r.kind,
            client=r.client,
            arrival_s=self.times.arrival,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            pipeline=pipeline.value,
            hit_rate=self.hit_rate,
            prefill_hit=self.prefill_hit,
            **latencies(self.times),
            wan_bytes=self.wan_bytes,
            believed_wan_bytes=self.believed_wan_bytes,
            wan_waited_blocks=len(self.md_waited),
            md_recomputed_tokens=self.md_recomputed_tokens,
            rld_tokens=_produced(self.rld_seq),
            md_tokens=_produced(self.md_seq),
            handoff_mode=self.mode.value if self.mode else None,
            filtered=self.filtered,
            prefill=self.prefill.name,
            decode=self.md.name,
            relay=self.relay.name if self.relay else None,
        )


def _produced(seq: Seq | None) -> int:
    """Tokens a decoder produced for the request (each reached the router by the sequence's sink)."""
    return seq.produced if seq is not None else 0
