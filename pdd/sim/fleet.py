"""The fleet at work on one request: route, prefill, KV over the links, decode on MD (or the
relay first, see handoff.py), and the record once the last token reaches the router.

Latencies: dc-a (router, P, RLD) messages take no time; a control message to or from dc-b
(prepare, its reply, kv_ready, handoff batches, acks, MD's cache events) takes one WAN
crossing, not queued behind KV; MD's tokens reach the router one crossing later.

A prefix crosses the WAN once (`share_in_flight`, shared/engine/in_flight.py's rule): a block
on its way to an MD is held for every request that needs it; a request waits for the blocks
another's transfer carries (its own KV and theirs both landed, in whatever order), and those
whose carrier dropped out (its client left, the filter, output ended at once) MD computes
itself in one extend pass before the request decodes. Each landing caches what arrived."""

from __future__ import annotations

from collections.abc import Callable

from pdd.sim.agentic import output_block_hashes
from pdd.sim.decoder import DecodeInstance, Extend, Seq
from pdd.sim.events import EventLoop
from pdd.sim.handoff import Relaying
from pdd.sim.instance import Blocks, Instance
from pdd.sim.job import Job
from pdd.sim.link import Link
from pdd.sim.prefill import PrefillWork
from pdd.sim.records import RequestRecord, TokenTimes
from pdd.sim.router import SimRouter
from pdd.sim.sharing import present_upto, tokens_to_send
from pdd.sim.workload import SimRequest
from shared.bus.messages import Pipeline, Role
from shared.config import RelaySettings
from shared.engine.in_flight import BlocksInFlight


class Fleet:
    def __init__(
        self,
        loop: EventLoop,
        router: SimRouter,
        kv_bytes_per_token: int,
        block_size: int,
        kv_link: Callable[[str], Link],
        local_link: Callable[[str], Link],
        cross_dc: Link | None,
        by_name: dict[str, Instance],
        relay_settings: RelaySettings,
        share_in_flight: bool = True,
    ):
        self.loop, self.router, self.kv_bytes_per_token, self.block_size = (
            loop,
            router,
            kv_bytes_per_token,
            block_size,
        )
        self.kv_link, self.local_link, self.cross_dc, self.by_name = kv_link, local_link, cross_dc, by_name
        self.records: list[RequestRecord] = []
        self.on_finished: Callable[[Job], None] = lambda job: None
        self.relaying = Relaying(self, relay_settings)
        self.share_in_flight = share_in_flight
        self.in_flight: dict[str, BlocksInFlight] = {}  # per MD: its prompt blocks on the way
        self.md_jobs: dict[str, Job] = {}  # requests that claimed blocks on their MD, by md_key

    # ---- crossings -------------------------------------------------------------------------
    def cross(self, fn: Callable[[], None]) -> None:
        """A control message between the DCs (none at all in a same-DC fleet)."""
        if self.cross_dc is None:
            self.loop.at(self.loop.now, fn)
        else:
            self.cross_dc.message(fn)

    def crossing_s(self) -> float:
        return self.cross_dc.delay() if self.cross_dc else 0.0

    def md_cache_events(self, md: Instance) -> None:
        stored, evicted = md.drain_events()
        if stored or evicted:
            self.cross(lambda: self.router.on_cache_events(Role.MAIN_DECODE, md.name, stored, evicted))

    # ---- a request ---------------------------------------------------------------------------
    def arrive(self, req: SimRequest, arrived: float | None = None) -> Job:
        """`arrived`: when the request reached the router, if it waited there for the line."""
        now = self.loop.now
        plan = self.router.plan(req)
        inst = self.by_name
        relay = inst[plan.relay] if plan.relay else None
        job = Job(
            req,
            TokenTimes(now if arrived is None else arrived),
            plan.decision.pipeline,
            plan.decision.hit_rate,
            inst[plan.prefill],
            inst[plan.md],
            relay,
            self.crossing_s(),
        )
        job.believed_wan_bytes = plan.decision.missing_bytes if self.cross_dc else 0
        for role, name in (
            (Role.PREFILL, plan.prefill),
            (Role.RELAY, plan.relay),
            (Role.MAIN_DECODE, plan.md),
        ):
            if name:
                self.router.assignments.record((role.value, name), now)
                job.assigned.append(((role.value, name), now))
        work = PrefillWork(
            req.block_hashes,
            req.input_tokens,
            lambda n: self._kv_made(job, n),
            lambda: self._prefill_done(job),
        )
        job.prefill.submit(work)
        self.cross(lambda: self._prepare(job))
        return job

    def _prepare(self, job: Job) -> None:
        """MD takes blocks for the whole request (prefix hits shared), waiting while they do not fit."""
        self.reserve(job, job.md, self._md_reserved)

    def reserve(self, job: Job, inst: Instance, then: Callable[[Job, Blocks], None]) -> None:
        """Blocks on a decoder for the whole request (prompt and output), unless it ended."""
        if not job.done:
            total = job.req.input_tokens + job.req.output_tokens
            inst.reserve(job.req.block_hashes, total, lambda blocks: then(job, blocks))

    def _md_reserved(self, job: Job, blocks: Blocks) -> None:
        job.md_blocks = blocks
        self.md_cache_events(job.md)
        if job.done:
            self.drop_md(job)
            return
        if self.share_in_flight:
            self._claim(job, blocks)
        hit = min(blocks.hits * self.block_size, job.req.input_tokens)
        self.cross(lambda: self._md_target(job, hit))

    def _claim(self, job: Job, blocks: Blocks) -> None:
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
        self.md_jobs[job.md_key] = job

    def _md_target(self, job: Job, hit_tokens: int) -> None:
        """MD's reply is back: P streams it what it lacks. MD keeps the prompt's blocks once
        they land: the router counts them as its own now (as the router service does)."""
        job.md_hit_tokens = hit_tokens
        self.router.ctx.index.apply(job.md.name, list(job.req.block_hashes), [])
        self._stream_wan(job)

    def _kv_made(self, job: Job, upto: int) -> None:
        if not job.prefill_admitted:  # the first call: P's cached prefix
            job.prefill_admitted = True
            job.prefill_hit = upto / job.req.input_tokens
        job.kv_upto = upto
        self._stream_wan(job)
        self._stream_local(job)

    def _prefill_done(self, job: Job) -> None:
        now = self.loop.now
        job.prefill_done = True
        job.times.add(now, now, 1, 0.0)  # P samples the first token; the router is beside it
        if job.req.output_tokens <= 1:
            self.abort_wan(job)
            self.cross(lambda: self.drop_md(job))
            self.finish(job)
            return
        self._stream_wan(job)
        self._stream_local(job)

    def _stream_wan(self, job: Job) -> None:
        """P's new KV that MD lacks onto the link; after the last of it, the done marker."""
        if job.md_hit_tokens is None or job.done:
            return
        kvbpt, link = self.kv_bytes_per_token, self.kv_link(job.md.name)
        start, upto = max(job.wan_sent_upto, job.md_hit_tokens), job.kv_upto
        if upto > start:
            if not self.share_in_flight:
                job.wan_transfers.append(link.send((upto - start) * kvbpt, _nothing, job.md.name))
            elif tokens := tokens_to_send(start, upto, job.md_waited, self.block_size):
                landed = lambda: self._md_chunk_landed(job, upto)  # noqa: E731
                job.wan_transfers.append(link.send(tokens * kvbpt, landed, job.md.name))
        job.wan_sent_upto = max(job.wan_sent_upto, job.kv_upto)
        if job.prefill_done and job.wan_sent_upto == job.req.input_tokens:
            job.wan_sent_upto += 1  # the marker goes once
            job.wan_transfers.append(link.send(0, lambda: self._md_kv_landed(job), job.md.name))

    def _stream_local(self, job: Job) -> None:
        """On P→RLD→MD the relay gets the whole prompt's KV over the local path."""
        if job.relay is None or job.done:
            return
        link = self.local_link(job.relay.name)
        if job.kv_upto > job.local_sent_upto:
            link.send((job.kv_upto - job.local_sent_upto) * self.kv_bytes_per_token, _nothing, job.relay.name)
        job.local_sent_upto = max(job.local_sent_upto, job.kv_upto)
        if job.prefill_done and job.local_sent_upto == job.req.input_tokens:
            job.local_sent_upto += 1
            link.send(0, lambda: self.relaying.kv_landed(job), job.relay.name)

    # ---- MD's side of the prompt's KV ---------------------------------------------------------
    def _md_chunk_landed(self, job: Job, upto: int) -> None:
        """The request's own KV up to prompt token `upto` landed: its blocks are cached for all."""
        if self.md_jobs.get(job.md_key) is not job:
            return  # MD dropped it: what still lands is not kept
        job.md_landed_upto = max(job.md_landed_upto, upto)
        came, bs = [], self.block_size
        while job.md_carry and (job.md_carry[0] + 1) * bs <= job.md_landed_upto:
            came.append(job.req.block_hashes[job.md_carry.pop(0)])
        self._md_register_present(job)
        self._md_resolved(job.md, self.in_flight[job.md.name].landed(job.md_key, came), lost=False)

    def _md_register_present(self, job: Job) -> None:
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
            self.md_cache_events(job.md)

    def _md_resolved(self, md: DecodeInstance, out: dict[str, list[int]], lost: bool) -> None:
        """Waiters whose blocks landed (or were lost): each goes on once it waits for nothing."""
        waits = self.in_flight[md.name]
        for key, hashes in out.items():
            w = self.md_jobs.get(key)
            if w is None:
                continue
            if lost:
                w.md_lost.update(hashes)
            else:
                self._md_register_present(w)
            if w.md_marker_landed and not waits.waiting(key):
                self._md_start(w)

    def _md_kv_landed(self, job: Job) -> None:
        """All of the request's own KV is in; it goes on once the blocks others carry are too."""
        if job.done or job.md_blocks is None:
            return
        if self.share_in_flight:
            job.md_marker_landed = True
            self._md_chunk_landed(job, job.req.input_tokens)
            if self.in_flight[job.md.name].waiting(job.md_key):
                return
        self._md_start(job)

    def _md_start(self, job: Job) -> None:
        """MD holds the prompt's KV but for lost blocks: it computes those in one extend pass,
        then P→MD decodes from token 2 and P→RLD→MD tells the relay."""
        if job.md_started or job.done:
            return
        job.md_started = True
        job.md_seq = Seq(
            job.req.input_tokens,
            job.req.output_tokens - 1,
            self.md_token_sink(job),
            lambda: self._md_finished(job),
        )
        lost = len(job.md_lost) * self.block_size
        if not lost:
            self._md_ready(job, imported=True)
            return
        job.md_recomputed_tokens, job.md_seq.context = lost, job.req.input_tokens - lost
        job.md_extending += 1
        job.md.extend(Extend(job.md_seq, lost, False, lambda: self._md_recomputed(job)))

    def _md_recomputed(self, job: Job) -> None:
        job.md_extending -= 1
        if job.md_dropped:
            self.drop_md(job)
            return
        job.md_lost.clear()
        self._md_ready(job, imported=False)

    def _md_ready(self, job: Job, imported: bool) -> None:
        """`imported`: the KV came in over the wire (the engine imports it between two steps)."""
        job.md.register(job.md_blocks, job.req.block_hashes, len(job.req.block_hashes))
        self.md_cache_events(job.md)
        if job.pipeline is Pipeline.P_MD:
            (job.md.join_imported if imported else job.md.join)(job.md_seq)
        elif imported:  # MD imports the last of it between two steps, then tells the relay
            job.md.at_boundary(lambda: self.cross(lambda: self.relaying.kv_ready(job)))
        else:
            self.cross(lambda: self.relaying.kv_ready(job))

    def md_token_sink(self, job: Job):
        def sink(first: float, last: float, n: int, gap: float) -> None:
            job.times.add(first + job.md_delay_s, last + job.md_delay_s, n, gap)

        return sink

    def _md_finished(self, job: Job) -> None:
        # As the engine does, MD keeps the KV of the tokens it generated too: the session's next
        # turn starts with them (pdd/sim/agentic.py names those blocks).
        if job.md_blocks is not None:
            hashes = job.req.block_hashes + output_block_hashes(job.req, self.block_size)
            job.md.register(job.md_blocks, hashes, len(hashes))
        self.drop_md(job)
        self.finish(job)

    # ---- the end -------------------------------------------------------------------------------
    def abort_wan(self, job: Job) -> None:
        """Stop the request's KV toward MD: what is queued leaves the link, what was sent counts."""
        link = self.kv_link(job.md.name)
        for t in job.wan_transfers:
            link.abort(t)

    def drop_md(self, job: Job) -> None:
        """MD frees the request's blocks (once: after an extend in progress, if one is)."""
        job.md_dropped = True
        if self.md_jobs.get(job.md_key) is job:  # it waits for nothing now; what it owed is lost
            del self.md_jobs[job.md_key]
            self._md_resolved(job.md, self.in_flight[job.md.name].dropped(job.md_key), lost=True)
        if job.md_blocks is not None and job.md_extending == 0:
            job.md.free(job.md_blocks)
            job.md_blocks = None
            self.md_cache_events(job.md)

    def finish(self, job: Job) -> None:
        """The last token reached the router (in `job.times`): record the request."""
        job.done = True
        for key, at in job.assigned:
            self.router.assignments.finished(key, at)
        self.records.append(job.record())
        # Nothing reads these after the end, and each ties the job in a cycle through its
        # callbacks: dropped, the job is freed as it ends, not by a collection of the whole heap.
        job.md_seq = job.rld_seq = None
        job.wan_transfers = []
        self.on_finished(job)


def _nothing() -> None:
    pass
