"""What a simulation replays: requests with their arrival, lengths and prompt block hashes."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SimRequest:
    rid: int
    arrival_s: (
        float  # open loop: when it arrives; closed loop: think time after its client's previous request ended
    )
    input_tokens: int
    output_tokens: int
    # Chained hashes (shared/engine/hashing.py) of the prompt's full blocks, in order:
    # len == input_tokens // Workload.block_size. Equal prefixes have equal leading hashes.
    block_hashes: tuple[int, ...]
    client: int | None = None  # closed loop: a client's requests run one after the other
    kind: str = ""  # the generator's label ("high", "low", "outlier"); "" for a replayed trace
    # Closed loop: a client's first request of a later wave waits until every request of the
    # earlier waves has ended (a benchmark that runs its agents in waves, as `pdd bench e2e` does).
    wave: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    block_size: int  # tokens per hashed block
    requests: tuple[SimRequest, ...]  # open loop: by arrival_s; closed loop: each client's in order
    closed_loop: bool = False

    def at_rate(self, factor: float) -> Workload:
        """The same requests arriving `factor` times as fast (open loop; the goodput sweep)."""
        if self.closed_loop:
            raise ValueError("a closed-loop workload has no arrival rate to scale")
        return replace(
            self, requests=tuple(replace(r, arrival_s=r.arrival_s / factor) for r in self.requests)
        )

    @property
    def duration_s(self) -> float:
        return max((r.arrival_s for r in self.requests), default=0.0) if not self.closed_loop else 0.0
