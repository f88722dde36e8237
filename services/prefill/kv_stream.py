"""Prefill's KV streams: per request, one sender per destination that sends the blocks queued
for it (to MD over the WAN, over the RDMA path where both ends have it; to the relay over the
local path), waits for the ack, and feeds the WAN link estimator."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable

from opentelemetry import trace
from opentelemetry.trace import Span

from shared.bus.codec import encode
from shared.bus.messages import LinkReport, RelayStart
from shared.config import PrefillSettings
from shared.kv import KVClient, KVClientPool, KVTransfer, KVTransferError, LinkEstimator
from shared.telemetry import metrics
from shared.telemetry.span_store import REQUEST_ID_ATTR
from shared.telemetry.tracing import traceparent

from .job import END, KVPath, PrefillJob
from .rdma_path import RdmaLink, RdmaPeers

log = logging.getLogger(__name__)

Failed = Callable[[PrefillJob, KVPath, Exception], Awaitable[None]]  # a stream failed (logged already)
Ended = Callable[[PrefillJob], Awaitable[None]]  # a sender is done, in its own task


class KVStreamer:
    def __init__(
        self,
        settings: PrefillSettings,
        tracer: trace.Tracer,
        spawn: Callable[[Awaitable], asyncio.Task],
        kv_clients: KVClientPool,
        rdma: RdmaPeers,
        failed: Failed,
        ended: Ended,
    ):
        self.settings = settings
        self.tracer = tracer
        self.spawn = spawn
        self.kv_clients = kv_clients
        self.rdma = rdma
        self.failed = failed
        self.ended = ended
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
        transfer = job.transfers[path] = KVTransfer(
            self.kv_clients, address, job.rid, timeout=self.settings.request_timeout_s
        )
        try:
            sent, t_first = await self._stream(job, path, transfer, queue, traceparent_of(span))
            payload = encode(self._relay_start(job, span)) if path is KVPath.LOCAL else b""
            await transfer.finish(payload)
            if path is KVPath.WAN and transfer.client is not None and not transfer.reconnects:
                self._observe_link(
                    address, transfer.client, sent, t_first, time.monotonic()
                )  # no outage in it
        except asyncio.CancelledError:
            raise
        except Exception as e:  # transfer errors, timeouts, and bugs alike end the request cleanly
            if not isinstance(e, KVTransferError | TimeoutError | OSError):
                log.exception("%s transfer of %s crashed", path.value, job.rid)
            log.warning("%s transfer of %s to %s failed: %s", path.value, job.rid, address, e)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
            await self.failed(job, path, e)
        finally:
            span.set_attributes(
                {
                    "bytes": sent,
                    "duration_s": time.monotonic() - t_start,
                    "reconnects": transfer.reconnects,
                    "rdma_bytes": job.rdma_bytes,
                }
            )
            span.end()
            job.transfers.pop(path, None)
            transfer.close()
            await self.ended(job)

    async def _stream(
        self, job: PrefillJob, path: KVPath, transfer: KVTransfer, queue: asyncio.Queue, tp: str | None
    ) -> tuple[int, float | None]:
        """Send queued blocks until the end marker: (bytes sent, time of the first block).
        To MD over the RDMA path where both ends have it, the rest over the TCP channel."""
        timeout = self.settings.request_timeout_s
        sent, t_first = 0, None
        link = await self._open_rdma(job) if path is KVPath.WAN else None
        try:
            while (item := await asyncio.wait_for(queue.get(), timeout=timeout)) is not END:
                hashes, kv = item
                t_first = t_first or time.monotonic()
                n = await self._send_group(transfer, link, hashes, kv, tp)
                sent += n
                if path is KVPath.WAN:
                    job.wan_bytes += n
                    job.wan_queued = max(job.wan_queued - kv.numel() * kv.element_size(), 0)
                metrics.KV_BYTES.labels(path=path.value).inc(n)
            if link is not None:
                sent += await self._resend(job, transfer, link, tp)
        finally:
            if link is not None:
                link.cancel()
                job.rdma_bytes = link.bytes
        return sent, t_first

    async def _open_rdma(self, job: PrefillJob) -> RdmaLink | None:
        if self.settings.kv_transport != "rdma":
            return None
        return await self.rdma.open(job.md_address, job.rid, job.md_missing)

    async def _send_group(
        self, transfer: KVTransfer, link: RdmaLink | None, hashes: list[int], kv, tp: str | None
    ) -> int:
        """One exported group: what MD gave RDMA slots for one-sided, the rest over TCP."""
        written, rest = await link.send(hashes, kv, tp) if link is not None else (0, list(range(len(hashes))))
        if not rest:
            return written
        part = kv if len(rest) == len(hashes) else kv[:, :, rest]
        return written + await transfer.send_blocks([hashes[i] for i in rest], part, traceparent=tp)

    async def _resend(self, job: PrefillJob, transfer: KVTransfer, link: RdmaLink, tp: str | None) -> int:
        """Blocks MD did not verify go again over TCP."""
        again, kv = await link.settle()
        if kv is None:
            return 0
        n = await transfer.send_blocks(again, kv, traceparent=tp)
        job.wan_bytes += n
        metrics.KV_BYTES.labels(path=KVPath.WAN.value).inc(n)
        return n

    def _relay_start(self, job: PrefillJob, span: Span) -> RelayStart:
        s = job.submit
        assert job.first_token is not None  # the local stream ends only after the first token
        return RelayStart(
            s.rid,
            s.prompt_ids,
            job.first_token,
            s.params,
            s.catchup_threshold,
            traceparent_of(span),
            router=s.router,
        )

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
