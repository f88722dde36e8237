"""Engines on one host: prefill publishes its backlog in a shared directory, a decoder gives
way to a burst of it (shared/serving/host_share.py). Real files and mmaps; time is real too,
with bounds far from the rules' thresholds."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from shared.serving import host_share
from shared.serving.engine_loop import EngineLoop
from shared.serving.host_share import GiveWay, PrefillBacklog
from tests.engine_util import greedy, make_engine

WAIT_S = 30


def test_a_decoder_reads_every_prefill_of_the_host(tmp_path) -> None:
    a, b = PrefillBacklog(tmp_path, "0"), PrefillBacklog(tmp_path, "1")
    way = GiveWay(tmp_path, max_s=10)
    a.publish(300)
    b.publish(200)
    assert way.backlog() == 500
    b.publish(-1)  # below zero counts as nothing
    assert way.backlog() == 300
    a.close()
    b.close()
    assert list(tmp_path.iterdir()) == []


def test_a_burst_is_given_way_to_until_it_is_gone_three_prompts_are_not(tmp_path) -> None:
    prefill, way = PrefillBacklog(tmp_path, "0"), GiveWay(tmp_path, max_s=10, above_tokens=768)
    prefill.publish(768)  # three prompts that came together: not a burst
    assert not way.should_wait()
    prefill.publish(2048)  # a wave of eight
    assert way.should_wait()
    prefill.publish(256)  # its last step: still given way to, until it has ended
    assert way.should_wait()
    prefill.publish(0)
    assert not way.should_wait()
    prefill.publish(768)  # a new three are not a burst again
    assert not way.should_wait()


def test_a_decoder_gives_way_at_most_max_s_in_a_row(tmp_path) -> None:
    prefill, way = PrefillBacklog(tmp_path, "0"), GiveWay(tmp_path, max_s=0.2)
    prefill.publish(4096)
    assert way.should_wait()
    time.sleep(0.3)  # the stimulus: max_s passes while the backlog stays
    prefill.publish(4096)
    assert not way.should_wait()  # it steps now, until the backlog is gone
    prefill.publish(0)
    assert not way.should_wait()
    prefill.publish(4096)  # a new burst: given way to again
    assert way.should_wait()


def test_a_record_not_renewed_is_ignored(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill that stopped or died with a backlog does not hold the decoders."""
    monkeypatch.setattr(host_share, "STALE_S", 0.2)
    prefill, way = PrefillBacklog(tmp_path, "0"), GiveWay(tmp_path, max_s=10)
    prefill.publish(4096)
    assert way.backlog() == 4096
    time.sleep(0.3)  # the stimulus: the record goes unrenewed past STALE_S
    assert way.backlog() == 0 and not way.should_wait()


def test_a_restarted_prefill_is_read_from_its_new_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_share, "RESCAN_S", 0.0)
    old, way = PrefillBacklog(tmp_path, "0"), GiveWay(tmp_path, max_s=10)
    old.publish(100)
    assert way.backlog() == 100
    new = PrefillBacklog(tmp_path, "0")  # the same instance id, a new file in its place
    new.publish(700)
    old.publish(5)  # the dead process's mapping no longer counts
    assert way.backlog() == 700
    started = PrefillBacklog(tmp_path, "1")  # one started since
    started.publish(1)
    assert way.backlog() == 701
    os.unlink(started.path)  # gone
    assert way.backlog() == 700


async def test_a_decoder_loop_takes_no_step_while_it_gives_way(tmp_path) -> None:
    """A real engine loop with a request to decode: no token while a burst is queued, tokens
    again once it is gone."""
    prefill, tokens, giving_way = PrefillBacklog(tmp_path, "0"), asyncio.Queue(), asyncio.Event()

    class Watched(GiveWay):
        def should_wait(self) -> bool:
            wait = super().should_wait()
            if wait:
                giving_way.set()
            return wait

    async def on_outputs(outputs, extra) -> None:
        for out in outputs:
            tokens.put_nowait(out)

    loop = EngineLoop(
        make_engine(), on_outputs, give_way=Watched(tmp_path, max_s=WAIT_S), call_timeout_s=WAIT_S
    )
    loop.start()
    renew = None
    try:
        await loop.call(loop.engine.add_request, "r", [1, 2, 3], greedy(1000))
        await asyncio.wait_for(tokens.get(), WAIT_S)
        # Renewed as prefill's steps would (a record not renewed for a second is ignored).
        renew = asyncio.create_task(_publish_every(prefill, 4096, 0.05))
        await asyncio.wait_for(giving_way.wait(), WAIT_S)  # every step before this one has ended
        while not tokens.empty():
            tokens.get_nowait()
        await asyncio.sleep(0.5)  # (an absence: watched for a while)
        assert tokens.empty()
        renew.cancel()
        prefill.publish(0)
        await asyncio.wait_for(tokens.get(), WAIT_S)
    finally:
        if renew:
            renew.cancel()
        await loop.stop()
        prefill.close()


async def _publish_every(prefill: PrefillBacklog, queued: int, every_s: float) -> None:
    while True:
        prefill.publish(queued)
        await asyncio.sleep(every_s)


def test_prefill_s_stats_count_the_prompt_tokens_it_has_not_run() -> None:
    engine = make_engine(kv_memory_mb=4.0, max_batched_tokens=16)
    engine.add_request("a", list(range(1, 41)), greedy(1))
    engine.add_request("b", list(range(1, 31)), greedy(1))
    assert engine.stats().pending_tokens == 70
    engine.step()  # 16 tokens of the first prompt
    assert engine.stats().pending_tokens == 54
