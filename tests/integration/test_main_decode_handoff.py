"""MD's handoff-batch intake: a redelivered batch (same seq again, or a seq already applied) is
dropped and counted; the first copy is the one applied. A real MD on a real NATS server and a
tiny engine; the handler and the drain are called directly so the order is exact."""

from __future__ import annotations

import torch
from prometheus_client import REGISTRY

from services.main_decode.service import MainDecodeService
from shared.bus import subjects
from shared.bus.connection import request
from shared.bus.messages import HandoffBatch, HandoffMode, Pipeline, PrepareReply, PrepareRequest
from shared.config import EngineSettings, MainDecodeSettings
from tests.engine_util import greedy, make_engine
from tests.polling import until_async


def _batch(seq: int, start: int, tokens: list[int]) -> HandoffBatch:
    return HandoffBatch("r", seq, start, tokens, final=False, mode=HandoffMode.CATCH_UP)


def _dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("pdd_handoff_batches_dropped_total", {"reason": reason}) or 0.0


async def test_a_redelivered_handoff_batch_is_dropped_and_the_first_copy_applied(
    nats_server, nats_security
) -> None:
    nc = await nats_security.connect(nats_server, "md-handoff-test")  # the test user may say anything
    settings = MainDecodeSettings(
        nats_url=nats_server.url,
        bulk_address="tcp://127.0.0.1:0",
        engine=EngineSettings(kv_memory_mb=1),
        secret="test-secret",
        instance="0",
    )
    md = MainDecodeService(settings, nc, make_engine())
    await md.start()
    stale, duplicate = _dropped("stale"), _dropped("duplicate")
    try:
        prepare = PrepareRequest("r", [1, 2, 3], greedy(16), [], Pipeline.P_MD)  # < 1 block: no KV
        reply = await request(nc, subjects.md_prepare("0"), prepare, PrepareReply, timeout=10)
        assert reply.ok and reply.missing == []
        job = md.jobs["r"]
        await md.prompt_kv.on_done("r", b"")  # prompt KV complete: READY for batches

        await md.on_handoff(_batch(0, 0, [5]), None)
        await md._drain_handoffs(job)
        assert (job.next_seq, job.next_index) == (1, 1)

        await md.on_handoff(_batch(0, 0, [5]), None)  # seq 0 again, after it was applied
        assert 0 not in job.batches and _dropped("stale") == stale + 1

        await md.on_handoff(_batch(2, 2, [7]), None)  # ahead of seq 1: held
        await md.on_handoff(_batch(2, 2, [8, 9]), None)  # seq 2 again while held
        assert job.batches[2][0].tokens == [7] and _dropped("duplicate") == duplicate + 1

        await md.on_handoff(_batch(1, 1, [6]), None)
        await md._drain_handoffs(job)  # applies 1, then the held first copy of 2
        assert (job.next_seq, job.next_index, job.batches) == (3, 3, {})
        assert "r" in md.jobs  # nothing failed the request
    finally:
        await md.stop()
        await nc.close()


async def test_a_request_waiting_on_a_carrier_that_sends_nothing_computes_those_blocks(
    nats_server, nats_security
) -> None:
    """The second of two requests sharing a prefix waits for the first's transfer; that one
    never sends a block (its prefill never got its target, its abort was lost): once no block
    landed for shared_kv_stall_s the second stops waiting and is READY, its extend computing them."""
    nc = await nats_security.connect(nats_server, "md-handoff-test")
    settings = MainDecodeSettings(
        nats_url=nats_server.url,
        bulk_address="tcp://127.0.0.1:0",
        engine=EngineSettings(kv_memory_mb=1),
        secret="test-secret",
        instance="0",
        shared_kv_stall_s=0.3,
    )
    md = MainDecodeService(settings, nc, make_engine())
    await md.start()
    try:
        prefix = list(range(1, 33))  # two full blocks
        hashes = md.engine.block_hashes
        carrier = PrepareRequest("a", prefix, greedy(4), hashes(prefix), Pipeline.P_MD)
        waiter_prompt = prefix + list(range(40, 56))
        waiter = PrepareRequest("b", waiter_prompt, greedy(4), hashes(waiter_prompt), Pipeline.P_MD)
        first = await request(nc, subjects.md_prepare("0"), carrier, PrepareReply, timeout=10)
        second = await request(nc, subjects.md_prepare("0"), waiter, PrepareReply, timeout=10)
        assert len(first.missing) == 2 and second.missing == hashes(waiter_prompt)[2:]  # only its own
        layers, two, _, *block = md.engine.kv_cache.shape
        await md.prompt_kv.on_blocks("b", second.missing, torch.zeros(layers, two, 1, *block), None)
        await md.prompt_kv.on_done("b", b"")  # its own KV is in
        job = md.jobs["b"]
        assert job.state.state.name == "RECEIVING"  # waits for the first's blocks
        await md._expire()
        assert job.state.state.name == "RECEIVING"  # not yet: the carrier is young

        async def computed() -> bool:  # once the carrier landed nothing for shared_kv_stall_s
            await md._expire()
            return job.state.state.name == "READY"

        await until_async(computed, 10, 0.05)
        assert job.computed_blocks == 2
        assert md.prompt_kv.in_flight.waiting("b") == set()
    finally:
        await md.stop()
        await nc.close()
