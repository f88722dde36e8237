"""Main decode's side of a request: the blocks it claims, the prompt's KV landing on it (a
prefix crosses the WAN once: shared/engine/in_flight.py's rule, `share_in_flight`), the
extend pass over blocks whose carrier dropped out, and MD's decoding to the end.

A block on its way to an MD is held for every request that needs it; a request waits for the
blocks another's transfer carries (its own KV and theirs both landed, in whatever order), and
those whose carrier dropped out (its client left, the filter, output ended at once) MD computes
itself in one extend pass before the request decodes. Each landing caches what arrived."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdd.sim.fleet.decoder import DecodeInstance, Extend, Seq
from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.handoff import Relaying
from pdd.sim.fleet.instance import Blocks, Instance
from pdd.sim.fleet.job import Job
from pdd.sim.fleet.router import SimRouter
from pdd.sim.fleet.sharing import present_upto
from pdd.sim.workloads.agentic import output_block_hashes
from shared.bus.messages import Pipeline, Role
from shared.engine.in_flight import BlocksInFlight


class FleetSide(Protocol):
    """What MD's side asks of the fleet it runs in (pdd/sim/fleet/requests.py)."""

    router: SimRouter
    relaying: Relaying

    loop: EventLoop

    def cross(self, fn: Callable[[], None]) -> None: ...
    def finish(self, job: Job) -> None: ...


class MainDecodeSide:
    def __init__(self, fleet: FleetSide, block_size: int, share_in_flight: bool):
        self.fleet, self.block_size, self.share_in_flight = fleet, block_size, share_in_flight
        self.in_flight: dict[str, BlocksInFlight] = {}  # per MD: its prompt blocks on the way
        self.jobs: dict[str, Job] = {}  # requests that claimed blocks on their MD, by md_key

    def cache_events(self, md: Instance) -> None:
        stored, evicted = md.drain_events()
        if stored or evicted:
            self.fleet.cross(
                lambda: self.fleet.router.on_cache_events(Role.MAIN_DECODE, md.name, stored, evicted)
            )

    def claim(self, job: Job, blocks: Blocks) -> None:
        """MD's blocks the prompt lacks: those it carries itself, those others' transfers bring."""
        hashes = job.req.block_hashes
        job.md_key = str(job.req.rid)
        carry, wait = self.in_flight.setdefault(job.md.name, BlocksInFlight()).claim(
            job.md_key, list(hashes[blocks.hits :])
        )
        if wait:
            where = {h: j for j, h in enumerate(hashes)}
            job.md_carry, job.md_waited = [where[h] for h in carry], sorted(where[h] for h in wait)
        else:
            job.md_carry = list(range(blocks.hits, len(hashes)))
        self.jobs[job.md_key] = job

    def chunk_landed(self, job: Job, upto: int) -> None:
        """The request's own KV up to prompt token `upto` landed: its blocks are cached for all."""
        if self.jobs.get(job.md_key) is not job:
            return  # MD dropped it: what still lands is not kept
        job.md_landed_upto = max(job.md_landed_upto, upto)
        came, bs = [], self.block_size
        while job.md_carry and (job.md_carry[0] + 1) * bs <= job.md_landed_upto:
            came.append(job.req.block_hashes[job.md_carry.pop(0)])
        self._register_present(job)
        self._resolved(job.md, self.in_flight[job.md.name].landed(job.md_key, came), lost=False)

    def _register_present(self, job: Job) -> None:
        """Cache the prompt's leading blocks whose KV is on MD now (its own or a carrier's)."""
        blocks, hashes, bs = job.md_blocks, job.req.block_hashes, self.block_size
        waited, waiting = set(job.md_waited), self.in_flight[job.md.name].waiting(job.md_key)

        def present(j: int) -> bool:
            h = hashes[j]
            if j in waited:
                return h not in waiting and h not in job.md_lost
            return (j + 1) * bs <= job.md_landed_upto

        upto = present_upto(blocks.registered, len(hashes), present)
        if upto > blocks.registered:
            job.md.register(blocks, hashes, upto)
            self.cache_events(job.md)

    def _resolved(self, md: DecodeInstance, out: dict[str, list[int]], lost: bool) -> None:
        """Waiters whose blocks landed (or were lost): each goes on once it waits for nothing."""
        waits = self.in_flight[md.name]
        for key, hashes in out.items():
            w = self.jobs.get(key)
            if w is None:
                continue
            if lost:
                w.md_lost.update(hashes)
            else:
                self._register_present(w)
            if w.md_marker_landed and not waits.waiting(key):
                self._start(w)

    def kv_landed(self, job: Job) -> None:
        """All of the request's own KV is in; it goes on once the blocks others carry are too."""
        if job.done or job.md_blocks is None:
            return
        if self.share_in_flight:
            job.md_marker_landed = True
            self.chunk_landed(job, job.req.input_tokens)
            if self.in_flight[job.md.name].waiting(job.md_key):
                return
        self._start(job)

    def _start(self, job: Job) -> None:
        """MD holds the prompt's KV but for lost blocks: it computes those in one extend pass,
        then P→MD decodes from token 2 and P→RLD→MD tells the relay."""
        if job.md_started or job.done:
            return
        job.md_started = True
        job.md_seq = Seq(
            job.req.input_tokens,
            job.req.output_tokens - 1,
            self.token_sink(job),
            lambda: self._finished(job),
        )
        lost = len(job.md_lost) * self.block_size
        if not lost:
            self._ready(job, imported=True)
            return
        job.md_recomputed_tokens, job.md_seq.context = lost, job.req.input_tokens - lost
        job.md_extending += 1
        job.md.extend(Extend(job.md_seq, lost, False, lambda: self._recomputed(job)))

    def _recomputed(self, job: Job) -> None:
        job.md_extending -= 1
        if job.md_dropped:
            self.drop(job)
            return
        job.md_lost.clear()
        self._ready(job, imported=False)

    def _ready(self, job: Job, imported: bool) -> None:
        """`imported`: the KV came in over the wire (the engine imports it between two steps)."""
        job.md.register(job.md_blocks, job.req.block_hashes, len(job.req.block_hashes))
        self.cache_events(job.md)
        if job.pipeline is Pipeline.P_MD:
            # MD streams P's token once the request takes a slot in its batch
            job.md_seq.on_start = lambda at: job.first_out(at + job.md_delay_s)
            (job.md.join_imported if imported else job.md.join)(job.md_seq)
        elif imported:  # MD imports the last of it between two steps, then tells the relay
            job.md.at_boundary(lambda: self.fleet.cross(lambda: self.fleet.relaying.kv_ready(job)))
        else:
            self.fleet.cross(lambda: self.fleet.relaying.kv_ready(job))

    def token_sink(self, job: Job):
        def sink(first: float, last: float, n: int, gap: float) -> None:
            job.times.add(first + job.md_delay_s, last + job.md_delay_s, n, gap)

        return sink

    def _finished(self, job: Job) -> None:
        # As the engine does, MD keeps the KV of the tokens it generated too: the session's next
        # turn starts with them (pdd/sim/workloads/agentic.py names those blocks).
        if job.md_blocks is not None:
            hashes = job.req.block_hashes + output_block_hashes(job.req, self.block_size)
            job.md.register(job.md_blocks, hashes, len(hashes))
        self.drop(job)
        self.fleet.finish(job)

    def drop(self, job: Job) -> None:
        """MD frees the request's blocks (once: after an extend in progress, if one is)."""
        job.md_dropped = True
        if self.jobs.get(job.md_key) is job:  # it waits for nothing now; what it owed is lost
            del self.jobs[job.md_key]
            self._resolved(job.md, self.in_flight[job.md.name].dropped(job.md_key), lost=True)
        if job.md_blocks is not None and job.md_extending == 0:
            job.md.free(job.md_blocks)
            job.md_blocks = None
            self.cache_events(job.md)
