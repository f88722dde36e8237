"""The fleet at work on one request: route, prefill, KV over the links, decode on MD (or the
relay first, see handoff.py; MD's side in md_side.py), and the record once the last token
reaches the router.

The user's first token: by default the decoder's (RLD's at once, MD's one crossing later),
which streams the token P sampled once it holds the request, as PD systems stream their
output from the decode side; `first_token_at_prefill` sends it from P to the router at once,
as pdd's prefill service does.

Latencies: dc-a (router, P, RLD) messages take no time; a control message to or from dc-b
(prepare, its reply, kv_ready, handoff batches, acks, MD's cache events) takes one WAN
crossing, not queued behind KV; MD's tokens reach the router one crossing later."""

from __future__ import annotations

from collections.abc import Callable

from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.handoff import Relaying
from pdd.sim.fleet.instance import Blocks, Instance
from pdd.sim.fleet.job import Job
from pdd.sim.fleet.link import Link
from pdd.sim.fleet.md_side import MainDecodeSide
from pdd.sim.fleet.prefill import PrefillWork
from pdd.sim.fleet.records import RequestRecord, TokenTimes
from pdd.sim.fleet.router import SimRouter
from pdd.sim.fleet.sharing import tokens_to_send
from pdd.sim.workloads.workload import SimRequest
from shared.bus.messages import Role
from shared.config import RelaySettings


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
        first_token_at_prefill: bool = False,
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
        self.first_token_at_prefill = first_token_at_prefill
        self.md_side = MainDecodeSide(self, block_size, share_in_flight)

    # ---- crossings -------------------------------------------------------------------------
    def cross(self, fn: Callable[[], None]) -> None:
        """A control message between the DCs (none at all in a same-DC fleet)."""
        if self.cross_dc is None:
            self.loop.at(self.loop.now, fn)
        else:
            self.cross_dc.message(fn)

    def crossing_s(self) -> float:
        return self.cross_dc.delay() if self.cross_dc else 0.0

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
        self.md_side.cache_events(job.md)
        if job.done:
            self.md_side.drop(job)
            return
        if self.share_in_flight:
            self.md_side.claim(job, blocks)
        hit = min(blocks.hits * self.block_size, job.req.input_tokens)
        self.cross(lambda: self._md_target(job, hit))

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
        if self.first_token_at_prefill or job.req.output_tokens <= 1:
            job.first_out(now)  # P samples the first token; the router is beside it
        if job.req.output_tokens <= 1:
            self.abort_wan(job)
            self.cross(lambda: self.md_side.drop(job))
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
                landed = lambda: self.md_side.chunk_landed(job, upto)  # noqa: E731
                job.wan_transfers.append(link.send(tokens * kvbpt, landed, job.md.name))
        job.wan_sent_upto = max(job.wan_sent_upto, job.kv_upto)
        if job.prefill_done and job.wan_sent_upto == job.req.input_tokens:
            job.wan_sent_upto += 1  # the marker goes once
            job.wan_transfers.append(link.send(0, lambda: self.md_side.kv_landed(job), job.md.name))

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

    # ---- the end -------------------------------------------------------------------------------
    def abort_wan(self, job: Job) -> None:
        """Stop the request's KV toward MD: what is queued leaves the link, what was sent counts."""
        link = self.kv_link(job.md.name)
        for t in job.wan_transfers:
            link.abort(t)

    def drop_md(self, job: Job) -> None:
        self.md_side.drop(job)

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
