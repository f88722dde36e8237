"""No request outlives request_timeout_s on the relay: a job that never decodes (the engine
refused its sequence after the prompt KV landed, and nobody aborts it) ends with an error
TokenEvent to the router, an abort to the other roles, and its pinned KV freed. A real relay
on a real NATS server with a tiny engine; its RelayStart comes first on the bus, its KV sink
is called directly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.relay.service import RelayService
from shared.bus import subjects
from shared.bus.connection import flushed, publish, subscribe
from shared.bus.messages import Abort, AbortReason, Outcome, RelayStart, TokenEvent
from shared.bus.subjects import Req
from shared.config import EngineSettings, RelaySettings
from shared.engine.errors import InvalidRequestError
from shared.telemetry import metrics
from tests.engine_util import greedy, make_engine
from tests.polling import until
from tests.prometheus_samples import parse_samples

TIMEOUT_S = 1.0  # the relay's request_timeout_s
WAIT_S = 30  # bound on the test's own waits


def _open_jobs() -> float | None:
    samples = parse_samples(metrics.metrics_text()[0].decode())
    return samples.get(("pdd_open_entries", frozenset({"service": "relay", "map": "jobs"}.items())))


async def test_a_stuck_relay_job_ends_with_an_error_at_the_request_timeout(
    nats_server, nats_security, tmp_path
):
    nc = await nats_security.connect(nats_server, "relay-expire-test")  # the test user may say anything
    settings = RelaySettings(
        nats_url=nats_server.url,
        local_address=f"unix://{tmp_path}/relay.sock",
        secret="test-secret",
        engine=EngineSettings(kv_memory_mb=1),
        request_timeout_s=TIMEOUT_S,
    )
    relay = RelayService(settings, nc, make_engine())
    errors: asyncio.Queue[TokenEvent] = asyncio.Queue()
    aborts: asyncio.Queue[Abort] = asyncio.Queue()

    async def on_tokens(ev: TokenEvent, raw) -> None:
        if ev.outcome is Outcome.ERROR:
            errors.put_nowait(ev)

    async def on_abort(msg: Abort, raw) -> None:
        aborts.put_nowait(msg)

    await subscribe(nc, subjects.req("stuck", Req.TOKENS), TokenEvent, on_tokens)
    await subscribe(nc, subjects.abort("stuck", "relay"), Abort, on_abort)
    await relay.start()
    try:
        prompt = list(range(1, 21))  # one full KV block
        hashes = relay.engine.block_hashes(prompt)
        layers, two, _, *block = relay.engine.kv_cache.shape
        await relay.on_blocks("stuck", hashes, torch.zeros(layers, two, len(hashes), *block), None)
        start = RelayStart("stuck", prompt, 6, greedy(4000))
        await publish(nc, subjects.to_instance("relay", settings.instance, Req.RELAY_START), start)
        await flushed(nc)
        await until(lambda: "stuck" in relay.early.start, WAIT_S)
        with pytest.raises(InvalidRequestError):  # more tokens than the whole pool holds
            await relay.on_done("stuck", b"")
        assert _open_jobs() == 1 and "stuck" in relay.engine.exchange.pins

        ev = await asyncio.wait_for(errors.get(), WAIT_S)
        assert "timed out on the relay" in (ev.error or "")
        abort = await asyncio.wait_for(aborts.get(), WAIT_S)
        assert abort.reason is AbortReason.FAILED
        assert relay.jobs == {} and _open_jobs() == 0
        held = await relay.engine_loop.call(lambda: (len(relay.engine.seqs), len(relay.engine.exchange.pins)))
        assert held == (0, 0)
    finally:
        await relay.stop()
        await nc.close()
