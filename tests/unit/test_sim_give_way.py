"""Decoders on prefill's host give way to its backlog (pdd/sim/fleet/give_way.py, the rule of
shared/serving/host_share.py). Hand-computable: every step of the FLAT chip takes 10 ms."""

import pytest

from pdd.sim.fleet.decoder import DecodeInstance, Seq
from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.give_way import GiveWayRule, share_host
from pdd.sim.fleet.prefill import PrefillInstance, PrefillWork
from pdd.sim.fleet.records import TokenTimes
from tests.sim_util import FLAT

EXACT = 1e-12


def _host(rule: GiveWayRule | None) -> tuple[EventLoop, PrefillInstance, DecodeInstance]:
    loop = EventLoop()
    p = PrefillInstance("p0", FLAT, loop, 1000, 16, 8, 2048, lambda *a: None, chunk_tokens=256)
    d = DecodeInstance("md0", FLAT, loop, 1000, 16, max_num_seqs=8, max_batched_tokens=64)
    if rule is not None:
        share_host(rule, [p], [d])
    return loop, p, d


def _prompt(p: PrefillInstance, tokens: int, first_hash: int = 0, done: list | None = None) -> PrefillWork:
    hashes = tuple(first_hash + i for i in range(tokens // 16))
    on_done = (lambda: done.append(p.loop.now)) if done is not None else (lambda: None)
    work = PrefillWork(hashes, tokens, lambda n: None, on_done)
    p.submit(work)
    return work


def _decoding(loop: EventLoop, d: DecodeInstance, tokens: int = 30) -> TokenTimes:
    times = TokenTimes(loop.now)
    times.add(loop.now, loop.now, 1, 0.0)  # P's token
    d.join(Seq(32, tokens, times.add, lambda: None))  # a step every 10 ms from now
    return times


@pytest.mark.parametrize(
    "rule, prompt, gap",
    [
        # 1,024 tokens in 4 chunks from 0.015 to 0.055: the decoder, at its boundary at 0.02, waits
        # for the backlog to be gone, then steps (0.055 to 0.065).
        (GiveWayRule(768, 0.5), 1024, 0.045),
        (GiveWayRule(768, 0.5), 512, 0.01),  # not a burst: no pause
        (None, 1024, 0.01),  # hosts of their own
        # 4,096 tokens take 0.16 s; the decoder waits 0.05 s at most, then steps until they are gone
        (GiveWayRule(768, 0.05), 4096, 0.06),
    ],
)
def test_a_decoder_gives_way_to_a_burst_of_prompt_tokens(rule, prompt, gap):
    loop, p, d = _host(rule)
    times = _decoding(loop, d)
    loop.at(0.015, lambda: _prompt(p, prompt))
    loop.run()
    assert times.count == 31 and times.max_gap == pytest.approx(gap, abs=EXACT)


def test_a_cached_prompt_counts_whole_until_its_first_step_ends():
    loop, p, d = _host(GiveWayRule(768, 0.5))
    done: list[float] = []
    _prompt(p, 1024, done=done)
    loop.run()  # now cached at P
    assert done == [pytest.approx(0.04, abs=EXACT)]
    _prompt(p, 1040, done=done)  # the same 1,024 tokens and one block more
    assert p.pending_tokens() == 1040  # the engine looks up its prefix only in the step that takes it
    loop.run()
    assert p.pending_tokens() == 0 and done[1] == pytest.approx(0.05, abs=EXACT)  # one 16-token step


def test_the_decoder_given_way_to_a_cached_prompt_waits_one_prefill_step():
    loop, p, d = _host(GiveWayRule(768, 0.5))
    _prompt(p, 1024)
    loop.run()  # cached at P by 0.04
    times = _decoding(loop, d)  # from 0.04
    loop.at(0.045, lambda: _prompt(p, 1040))  # P's one step: 0.045 to 0.055
    loop.run()
    assert times.max_gap == pytest.approx(0.005 + 0.01, abs=EXACT)  # boundary 0.05, steps again at 0.055
