"""`simulate`: one deployment serving one workload, on the project's own policy code.

The pieces, one per file, are listed in pdd/sim/__init__.py.

Simplifications a capacity planner should know: a decoder reserves KV blocks for the whole
request (prompt and output) when it takes it, so there is no preemption; MD's tokens reach
the router one WAN crossing later with one jitter sample per request; the relays' caches
are not indexed by the router (as in the service)."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdd.sim.fleet.decoder import DecodeInstance
from pdd.sim.fleet.deployment import Deployment, RoleSpec
from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.give_way import GiveWayRule, share_host
from pdd.sim.fleet.instance import Instance
from pdd.sim.fleet.job import Job
from pdd.sim.fleet.link import Link
from pdd.sim.fleet.prefill import PrefillInstance
from pdd.sim.fleet.records import SimResult
from pdd.sim.fleet.requests import Fleet
from pdd.sim.fleet.router import SimRouter
from pdd.sim.hardware.model_spec import ModelSpec
from pdd.sim.workloads.workload import SimRequest, Workload
from shared.bus.messages import Role
from shared.config import RelaySettings, RouterSettings


@dataclass
class SimSettings:
    router: RouterSettings = field(default_factory=RouterSettings)
    relay: RelaySettings = field(default_factory=RelaySettings)
    max_batched_tokens: int = 8192  # per step, per instance (chunked prefill)
    prefill_chunk: int = 0  # P's tokens of one prompt per step (0 = up to max_batched_tokens)
    max_num_seqs: int = 256
    seed: int = 0
    time_limit_s: float | None = None  # stop admitting and stop the clock here (None: run to the end)
    busy_spells: bool = False  # record when each instance computed (SimResult.busy_spells)
    share_in_flight: bool = (
        True  # a prompt block on its way to an MD is sent once (md_side.py); off: per request
    )
    # The user's first token from P at once (pdd's router) instead of from the decoder that
    # holds the request (RLD, or MD a crossing later: PD systems and the paper's TTFT).
    first_token_at_prefill: bool = False
    # Every engine on one host (`pdd up` on one machine, as `pdd bench e2e` runs): the decoders
    # give way to prefill's backlog by this rule (give_way.py). None: hosts of their own.
    give_way: GiveWayRule | None = None


def simulate(
    deployment: Deployment,
    workload: Workload,
    model: ModelSpec,
    settings: SimSettings | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Serve `workload` on `deployment`; on_progress(fraction of requests done) now and then."""
    started = time.perf_counter()
    s = settings or SimSettings()
    with (
        _cyclic_gc_paused()
    ):  # (from the fleet's making on: its prefix caches and indexes are millions of objects)
        sim = _Simulation(deployment, workload, model, s, on_progress or (lambda f: None))
        sim.start()
        sim.loop.run(s.time_limit_s)
    sim.on_progress(1.0)
    records = sorted(sim.fleet.records, key=lambda r: r.rid)
    busy = {role: sum(i.busy_s for i in insts) for role, insts in sim.roles.items()}
    bins = sim.wan.bins if sim.wan and sim.wan.bins is not None else []
    spells = {
        i.name: i.busy_spells for insts in sim.roles.values() for i in insts if i.busy_spells is not None
    }
    return SimResult(
        deployment.name,
        workload.name,
        records,
        sim.loop.now,
        time.perf_counter() - started,
        list(bins),
        busy,
        sim.loop.events,
        spells,
        sim.router.refused,
        sim.router.held_total,
    )


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection during a run: each pass would walk the fleet's millions
    of live objects (prefix caches, the router's indexes) for the little cyclic garbage that finished
    requests leave, a quarter or more of a long run's CPU. That garbage waits for the first
    collection after the run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Simulation:
    def __init__(
        self,
        d: Deployment,
        workload: Workload,
        model: ModelSpec,
        s: SimSettings,
        on_progress: Callable[[float], None],
    ):
        self.loop, self.workload, self.on_progress = EventLoop(), workload, on_progress
        self.rng = random.Random(s.seed)
        bs, kvbpt = workload.block_size, model.kv_bytes_per_token
        cross_dc = d.kind != "same-dc"

        def make(prefix: str, spec: RoleSpec, cls, seqs: int):
            blocks = spec.chip.kv_capacity_bytes // (bs * kvbpt)
            return [
                cls(f"{prefix}{i}", spec.chip, self.loop, blocks, bs, seqs, s.max_batched_tokens)
                for i in range(spec.count)
            ]

        prefills = make(
            "p",
            d.prefill,
            lambda *a: PrefillInstance(*a, self._prefill_events, s.prefill_chunk),
            s.max_num_seqs,
        )
        cap = lambda spec: spec.chip.max_seqs or s.max_num_seqs  # noqa: E731 (a chip's own decode batch cap)
        decodes = make("md" if cross_dc else "d", d.decode, DecodeInstance, cap(d.decode))
        relays = make("rld", d.relay, DecodeInstance, cap(d.relay)) if d.relay else []
        self.roles = {"prefill": prefills, "relay": relays, "decode": decodes}
        if s.give_way is not None:
            share_host(s.give_way, prefills, decodes + relays)
        by_name: dict[str, Instance] = {i.name: i for group in self.roles.values() for i in group}
        for inst in by_name.values() if s.busy_spells else ():
            inst.busy_spells = []
        # One cross-DC line that every P→MD transfer shares; in one DC, a path per decoder.
        self.wan = Link(self.loop, d.wan, self.rng, bins=[]) if cross_dc else None
        in_dc = {m.name: Link(self.loop, d.wan, self.rng) for m in decodes} if not cross_dc else {}
        local = {r.name: Link(self.loop, d.local, self.rng) for r in relays}
        kv_link = (lambda name: self.wan) if self.wan else in_dc.__getitem__
        instances = {Role.PREFILL: prefills, Role.RELAY: relays, Role.MAIN_DECODE: decodes}
        report_delay = d.wan.one_way_s if cross_dc else 0.0
        self.router = SimRouter(s.router, self.loop, bs, kvbpt, instances, kv_link, report_delay)
        self.fleet = Fleet(
            self.loop,
            self.router,
            kvbpt,
            bs,
            kv_link,
            local.__getitem__,
            self.wan,
            by_name,
            s.relay,
            s.share_in_flight,
            s.first_token_at_prefill,
        )
        self.fleet.on_finished = self._finished
        self.router.go = self.fleet.arrive
        self.router.refuse = self._refused
        self.done, self.total = 0, len(workload.requests)
        self.report_every = max(1, self.total // 100)
        self.next_of: dict[int, SimRequest] = {}  # closed loop: a request's successor of the same client
        self.wave_starts: dict[
            int, list[SimRequest]
        ] = {}  # closed loop: per wave, its clients' first requests
        self.left_in_wave: dict[int, int] = {}  # closed loop: per wave, its requests not yet ended

    def _prefill_events(self, instance: str, stored: list[int], evicted: list[int]) -> None:
        self.router.on_cache_events(Role.PREFILL, instance, stored, evicted)

    def start(self) -> None:
        self.on_progress(0.0)
        reqs = self.workload.requests
        if not reqs:
            return
        if not self.workload.closed_loop:
            self._arrive_open(0)
            return
        last_of: dict[object, SimRequest] = {}
        for r in reqs:
            self.left_in_wave[r.wave] = self.left_in_wave.get(r.wave, 0) + 1
            client = r.client if r.client is not None else ("solo", r.rid)
            prev = last_of.get(client)
            if prev is not None and prev.wave == r.wave:
                self.next_of[prev.rid] = r
            else:
                self.wave_starts.setdefault(r.wave, []).append(r)
            last_of[client] = r
        self._start_waves()

    def _start_waves(self) -> None:
        """Start the clients' first requests of every wave whose earlier waves have all ended."""
        while self.wave_starts:
            wave = min(self.wave_starts)
            if any(n for w, n in self.left_in_wave.items() if w < wave):
                return
            now = self.loop.now
            for r in self.wave_starts.pop(wave):
                self.loop.at(now + r.arrival_s, lambda r=r: self.router.admit(r))

    def _arrive_open(self, i: int) -> None:
        reqs = self.workload.requests
        self.loop.at(reqs[i].arrival_s, lambda: self._open_arrival(i))

    def _open_arrival(self, i: int) -> None:
        if i + 1 < len(self.workload.requests):
            self._arrive_open(i + 1)
        self.router.admit(self.workload.requests[i])

    def _finished(self, job: Job) -> None:
        self._ended(job.req, job.times.last)

    def _refused(self, req: SimRequest) -> None:
        """The router refused it (a 429): its client goes on to its next request, if any."""
        self._ended(req, self.loop.now)

    def _ended(self, req: SimRequest, at: float) -> None:
        self.done += 1
        if self.done % self.report_every == 0:
            self.on_progress(self.done / self.total)
        nxt = self.next_of.pop(req.rid, None)
        if nxt is not None:  # think time after the last token reached the router
            self.loop.at(at + nxt.arrival_s, lambda: self.router.admit(nxt))
        if self.workload.closed_loop:
            self.left_in_wave[req.wave] -= 1
            if not self.left_in_wave[req.wave]:
                self._start_waves()
