"""The relay's half of a P→RLD→MD request: decode as soon as the local KV lands, hand over to
MD by token IDs on MD's kv_ready (one-shot or catch-up, by the relay's own policy:
services/relay/handoff_policy.py), and the anomalous-traffic filter: a request the relay
finishes before handing over ends there, and its WAN transfer stops.

The relay asks its engine as services/relay/handoff.py does, each question a command that runs
when the step in progress ends: on kv_ready the output so far, then (one step later) how many
requests it runs, and picks the mode from both; the final batch's tokens are read, and decoding
stopped, by one more command."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdd.sim.fleet.decoder import Extend, Seq
from pdd.sim.fleet.instance import Blocks, Instance
from pdd.sim.fleet.job import Job
from services.relay.handoff_policy import catchup_batch_size, catchup_is_final, choose_handoff_mode
from shared.bus.messages import HandoffMode
from shared.config import RelaySettings


class FleetSide(Protocol):
    """What the relay's half asks of the fleet it runs in (pdd/sim/fleet/requests.py)."""

    def cross(self, fn: Callable[[], None]) -> None: ...
    def reserve(self, job: Job, inst: Instance, then: Callable[[Job, Blocks], None]) -> None: ...
    def abort_wan(self, job: Job) -> None: ...
    def drop_md(self, job: Job) -> None: ...
    def finish(self, job: Job) -> None: ...


class Relaying:
    def __init__(self, fleet: FleetSide, settings: RelaySettings):
        self.fleet, self.settings = fleet, settings

    # ---- decoding on the relay ---------------------------------------------------------------
    def kv_landed(self, job: Job) -> None:
        self.fleet.reserve(job, job.relay, self._start)

    def _start(self, job: Job, blocks: Blocks) -> None:
        relay = job.relay
        job.rld_blocks = blocks
        relay.register(blocks, job.req.block_hashes, len(job.req.block_hashes))
        relay.drain_events()  # no router keeps an index of the relays' caches
        if job.done:
            self._free(job)
            return
        # The router is beside the relay: its tokens reach it as they come, P's first (once
        # the request takes a slot in the relay's batch).
        job.rld_seq = Seq(
            job.req.input_tokens, job.req.output_tokens - 1, job.times.add, lambda: self._finished(job)
        )
        job.rld_seq.on_start = job.first_out
        relay.join_imported(job.rld_seq)
        if job.md_ready:
            self._begin_handoff(job)

    def _finished(self, job: Job) -> None:
        """The relay produced the last token while it held the request: the filter at work."""
        self._free(job)
        if job.relay_holds and not job.done:
            job.filtered = True
            self.fleet.abort_wan(job)
            self.fleet.cross(lambda: self.fleet.drop_md(job))
            self.fleet.finish(job)

    def _free(self, job: Job) -> None:
        if job.rld_blocks is not None:
            job.relay.free(job.rld_blocks)
            job.relay.drain_events()
            job.rld_blocks = None

    # ---- the handoff ---------------------------------------------------------------------------
    def kv_ready(self, job: Job) -> None:
        """MD's kv_ready reached the relay."""
        if job.done or job.md_ready:
            return
        job.md_ready = True
        if job.rld_seq is not None:
            self._begin_handoff(job)

    def _begin_handoff(self, job: Job) -> None:
        job.handing = True
        job.relay.at_boundary(lambda: self._snapshot(job))

    def _snapshot(self, job: Job) -> None:
        """The output so far (prefill's token first); the relay's load is the next command's."""
        if not job.done:
            tokens = 1 + job.rld_seq.produced
            job.relay.at_boundary(lambda: self._decide(job, tokens))

    def _decide(self, job: Job, tokens: int) -> None:
        if job.done:
            return
        s = self.settings
        job.mode = choose_handoff_mode(
            tokens - job.handed, job.relay.busy, s.catchup_threshold, s.catchup_load
        )
        if job.mode is HandoffMode.ONE_SHOT:
            self._stop(job)
        else:
            self._send_batch(job, tokens)

    def _send_batch(self, job: Job, tokens: int) -> None:
        """A catch-up batch (the relay's own rule for what it carries); none left: the final one."""
        batch = catchup_batch_size(tokens, job.handed)
        if batch <= 0:
            self._stop(job)
            return
        job.handed += batch
        job.rounds += 1
        job.md_extending += 1
        ext = Extend(job.md_seq, batch, False, lambda: self._extended(job))
        self.fleet.cross(lambda: job.md.extend(ext))

    def _extended(self, job: Job) -> None:
        """MD extended a catch-up batch: its ack crosses back."""
        job.md_extending -= 1
        if job.md_dropped:
            self.fleet.drop_md(job)
            return
        self.fleet.cross(lambda: self._on_ack(job))

    def _on_ack(self, job: Job) -> None:
        if not job.done:
            job.relay.at_boundary(lambda: self._continue(job))

    def _continue(self, job: Job) -> None:
        if job.done:
            return
        tokens = 1 + job.rld_seq.produced
        s = self.settings
        if catchup_is_final(tokens - job.handed, job.rounds, s.catchup_threshold, s.catchup_max_rounds):
            self._stop(job)
        else:
            self._send_batch(job, tokens)

    def _stop(self, job: Job) -> None:
        """The final batch: its tokens read, and decoding stopped, by a command of its own."""
        job.relay.at_boundary(lambda: job.done or self._send_final(job, 1 + job.rld_seq.produced))

    def _send_final(self, job: Job, tokens: int) -> None:
        """The relay stops (at this step boundary) and MD takes the rest."""
        job.relay.remove(job.rld_seq)
        self._free(job)
        job.handed_over = True
        batch, job.handed = tokens - job.handed, tokens
        job.md_seq.remaining = job.req.output_tokens - tokens
        job.md_extending += 1
        ext = Extend(job.md_seq, batch, True, lambda: self._final_extended(job))
        self.fleet.cross(lambda: job.md.extend(ext))

    def _final_extended(self, job: Job) -> None:
        job.md_extending -= 1
