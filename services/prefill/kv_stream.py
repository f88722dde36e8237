"""Prefill's KV streams: per request, one sender per destination that sends the blocks queued
for it (to MD over the WAN, to the relay over the local path; shared/kv/sender.py picks how),
waits for the ack, and feeds the WAN link estimator."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import Span

from shared.bus.messages import LinkReport
from shared.config import PrefillSettings
from shared.kv import KVClient, KVClientPool, KVTransferError, LinkEstimator
from shared.kv.sender import KVSender, KVSenders
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import traceparent

from .job import END, KVPath, PrefillJob

log = logging.getLogger(__name__)


class StreamEvents(Protocol):
    """What a stream tells the service, from the stream's own task."""

    async def stream_acked(self, job: PrefillJob, path: KVPath, traceparent: str | None) -> None:
        """The peer holds all of it (`traceparent`: the transfer's span, for what follows)."""

    async def stream_failed(self, job: PrefillJob, path: KVPath, e: Exception) -> None:
        """It failed (logged already)."""

    async def stream_ended(self, job: PrefillJob, path: KVPath) -> None:
        """It is done, however it went (last)."""


def kv_senders(
    settings: PrefillSettings, nc, pool: KVClientPool, local: KVClientPool | None = None
) -> KVSenders:
    """Prefill's senders as its settings say: the WAN codec, the request timeout as each
    transfer's bound, the RDMA path to main decoders when kv_transport is "rdma"."""
    rdma = settings.rdma if settings.kv_transport == "rdma" else None
    return KVSenders(
        nc, pool, local, wan_codec=settings.wan_kv_codec, timeout_s=settings.request_timeout_s, rdma=rdma
    )


class KVStreamer:
    def __init__(
        self,
        settings: PrefillSettings,
        tracer: trace.Tracer,
        spawn: Callable[[Awaitable], asyncio.Task],
        senders: KVSenders,
        events: StreamEvents,
    ):
        self.settings, self.tracer, self.spawn = settings, tracer, spawn
        self.senders, self.events = senders, events
        self.links = LinkEstimator()
        self._rtt_seen: weakref.WeakSet[KVClient] = weakref.WeakSet()  # connections whose RTT is counted
        self._labelled_peers: set[str] = set()  # peers with a WAN_BANDWIDTH series

    def start(self, job: PrefillJob, path: KVPath, address: str, queue: asyncio.Queue) -> None:
        job.senders[path] = self.spawn(self._ship(job, path, address, queue))

    async def cancel(self, job: PrefillJob, path: KVPath, reason: str) -> bool:
        """Stop one stream and tell its peer to drop what it got; False if it had ended."""
        task = job.senders.get(path)
        if task is None or task.done() or task is asyncio.current_task():
            return False
        transfer = job.transfers.get(path)
        task.cancel()
        if transfer is not None:
            try:
                await transfer.abort(reason)
            except Exception as e:  # the peer may already be gone
                log.debug("abort of %s on the %s path failed: %s", job.rid, path.value, e)
        return True

    def link_reports(self, jobs: Iterable[PrefillJob]) -> list[LinkReport]:
        """Measured links (otherwise the router keeps its configured prior) and the KV still
        queued toward each MD."""
        known = self.links.snapshot()
        metrics.forget_peers_except(self._labelled_peers, known)  # the estimator dropped them
        links = {
            peer: LinkReport(peer, bandwidth=info["bandwidth"], rtt=info["rtt"])
            for peer, info in known.items()
            if info["transfers"]
        }
        for job in jobs:
            if job.md_address and job.wan_queued:
                links.setdefault(job.md_address, LinkReport(job.md_address)).backlog += job.wan_queued
        return list(links.values())

    async def _ship(self, job: PrefillJob, path: KVPath, address: str, queue: asyncio.Queue) -> None:
        """Stream one destination's blocks for one request, then wait for its ack."""
        span = self.tracer.start_span(
            "kv.transfer",
            context=job.ctx,
            attributes={REQUEST_ID_ATTR: job.rid, "path": path.value, "peer": address},
        )
        t_start, sent = time.monotonic(), 0
        missing = job.md_missing if path is KVPath.WAN else None  # MD may take them in place
        sender = job.transfers[path] = self.senders.open(address, job.rid, missing)
        try:
            tp = traceparent_of(span)
            sent, kv_bytes, t_first, tail = await self._stream(job, path, sender, queue, tp)
            again = await sender.finish()
            sent += again
            self._count(job, path, again)
            if tail is not None:  # (the last blocks: handed over at tail[0], tail[1] KV bytes)
                metrics.KV_TAIL_SECONDS.labels(path=path.value).observe(time.monotonic() - tail[0])
                metrics.KV_TAIL_BYTES.labels(path=path.value).inc(tail[1])
            if path is KVPath.WAN and sender.client is not None and not sender.reconnects:
                # In KV bytes, as the router prices a transfer: a lossy WAN codec makes the
                # line carry them faster than its wire rate.
                self._observe_link(address, sender.client, kv_bytes, t_first, time.monotonic())  # no outage
            await self.events.stream_acked(job, path, tp)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # transfer errors, timeouts, and bugs alike end the request cleanly
            if not isinstance(e, KVTransferError | TimeoutError | OSError):
                log.exception("%s transfer of %s crashed", path.value, job.rid)
            log.warning("%s transfer of %s to %s failed: %s", path.value, job.rid, address, e)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
            await self.events.stream_failed(job, path, e)
        finally:
            if path is KVPath.WAN:
                job.rdma_bytes = sender.rdma_bytes
            span.set_attributes(
                {
                    "bytes": sent,
                    "duration_s": time.monotonic() - t_start,
                    "reconnects": sender.reconnects,
                    "rdma_bytes": job.rdma_bytes,
                }
            )
            span.end()
            job.transfers.pop(path, None)
            sender.close()
            await self.events.stream_ended(job, path)

    async def _stream(
        self, job: PrefillJob, path: KVPath, sender: KVSender, queue: asyncio.Queue, tp: str | None
    ) -> tuple[int, int, float | None, tuple[float, int] | None]:
        """Send queued blocks until the end marker: (bytes sent, KV bytes they carry, time of
        the first block, (when the last blocks were handed to the sender, their bytes))."""
        timeout = self.settings.request_timeout_s
        sent, kv_bytes, t_first, tail = 0, 0, None, None
        while (item := await asyncio.wait_for(queue.get(), timeout=timeout)) is not END:
            hashes, kv = item
            now = time.monotonic()
            t_first = t_first or now
            n = await sender.send(hashes, kv, tp)
            tail = (now, kv.numel() * kv.element_size())
            sent += n
            kv_bytes += tail[1]
            if path is KVPath.WAN:
                job.wan_queued = max(job.wan_queued - tail[1], 0)
            self._count(job, path, n)
        return sent, kv_bytes, t_first, tail

    @staticmethod
    def _count(job: PrefillJob, path: KVPath, n: int) -> None:
        if not n:
            return
        if path is KVPath.WAN:
            job.wan_bytes += n
        metrics.KV_BYTES.labels(path=path.value).inc(n)

    def _observe_link(
        self, address: str, client: KVClient, sent: int, t_first: float | None, t_end: float
    ) -> None:
        """Feed the link estimator: each connection's handshake RTT once, and goodput from
        first byte to ack."""
        if client.rtt and client not in self._rtt_seen:
            self._rtt_seen.add(client)
            self.links.observe_rtt(address, client.rtt)
        if t_first is not None:
            self.links.observe_transfer(address, sent, t_end - t_first)  # small transfers are ignored there
        metrics.WAN_BANDWIDTH.labels(peer=address).set(self.links.bandwidth(address))
        self._labelled_peers.add(address)


def traceparent_of(span: Span) -> str | None:
    with trace.use_span(span, end_on_exit=False):
        return traceparent()
