"""The engine runs its commands between steps on one thread (shared/serving/engine_loop.py):
a sequence whose KV arrives at a busy decoder is imported when the step in progress ends, and
added by a second command that waits for the step begun meanwhile. Hand-computable: every
step of the FLAT chip takes 10 ms."""

import pytest

from pdd.sim.fleet.decoder import DecodeInstance, Seq
from pdd.sim.fleet.events import EventLoop
from tests.sim_util import FLAT

EXACT = 1e-12


def _decoder() -> tuple[EventLoop, DecodeInstance]:
    loop = EventLoop()
    return loop, DecodeInstance("md0", FLAT, loop, 1000, 16, max_num_seqs=8, max_batched_tokens=64)


def _first_token(loop: EventLoop, d: DecodeInstance, at: float) -> list[float]:
    """When a sequence whose KV lands at `at` gets its first token (a list, filled by the run)."""
    first: list[float] = []
    seq = Seq(32, 3, lambda t0, t1, n, gap: first.append(t0) if not first else None, lambda: None)
    loop.at(at, lambda: d.join_imported(seq))
    return first


def test_a_busy_decoder_adds_the_sequence_one_step_after_its_import():
    loop, d = _decoder()
    d.join(Seq(32, 100, lambda *run: None, lambda: None))  # decoding from 0, a step every 10 ms
    first = _first_token(loop, d, at=0.015)
    loop.run()
    # Imported at 0.02 (the step in progress ends), added at 0.03 (the step begun at 0.02
    # ends), its first step ends at 0.04.
    assert first == [pytest.approx(0.04, abs=EXACT)]


def test_an_idle_decoder_adds_the_sequence_at_once():
    loop, d = _decoder()
    first = _first_token(loop, d, at=0.015)
    loop.run()
    assert first == [pytest.approx(0.025, abs=EXACT)]  # import and add at once, then one step
