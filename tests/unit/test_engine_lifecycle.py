"""Request lifecycle: the SeqStatus of each mode from admission to the end; abort and release
in every state."""

from __future__ import annotations

import random

from shared.engine import FinishReason, Mode
from shared.engine.sequence import SeqStatus
from tests.engine_util import greedy, make_engine, random_prompt, run_all

TIGHT_MB = 12 * 16 * 512 / 2**20  # 12 blocks of 16 tokens


def test_each_mode_ends_in_its_own_state():
    engine = make_engine()
    rng = random.Random(33)
    for rid, mode in (("g", "generate"), ("h", "hold"), ("p", "prefill")):  # plain strings still work
        engine.add_request(rid, random_prompt(rng, 20), greedy(4), mode=mode)
    seqs = dict(engine.seqs)
    assert [s.mode for s in seqs.values()] == [Mode.GENERATE, Mode.HOLD, Mode.PREFILL]
    assert all(type(s.mode) is Mode for s in seqs.values())
    assert {s.status for s in seqs.values()} == {SeqStatus.WAITING}
    engine.step()
    assert seqs["g"].status is SeqStatus.RUNNING
    assert seqs["h"].status is SeqStatus.HELD  # all KV computed, logits kept
    assert seqs["p"].status is SeqStatus.PREFILLED  # first token out, blocks kept
    stats = engine.stats()
    assert (stats.held, stats.prefilled, stats.running) == (1, 1, 1)
    assert stats.used_blocks == 3 * 2  # all three keep their blocks
    run_all(engine)
    assert seqs["g"].status is SeqStatus.DONE and "g" not in engine.seqs
    assert seqs["g"].block_table == []
    engine.release("p")
    assert seqs["p"].status is SeqStatus.DONE and engine.stats().prefilled == 0
    assert engine.abort("h")
    assert seqs["h"].status is SeqStatus.DONE and engine.stats().held == 0
    assert engine.stats().used_blocks == 0


def test_preempted_sequence_waits_again():
    engine = make_engine(TIGHT_MB)
    rng = random.Random(34)
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(rng, 30), greedy(60))  # 4 x up to 6 blocks > 12
    seqs = dict(engine.seqs)
    preempted = set()  # waiting again after generating: sent back to the queue, blocks freed
    while engine.has_unfinished():
        engine.step()
        for rid, s in seqs.items():
            if s.status is SeqStatus.WAITING and s.num_generated > 0:
                assert s.block_table == [] and s.num_computed_tokens == 0
                preempted.add(rid)
    assert preempted and engine.stats().preemptions > 0
    assert {s.status for s in seqs.values()} == {SeqStatus.DONE}


def test_abort_and_release_in_every_state():
    engine = make_engine()
    rng = random.Random(31)
    for rid, mode in (("w", Mode.GENERATE), ("r", Mode.GENERATE), ("h", Mode.HOLD), ("p", Mode.PREFILL)):
        engine.add_request(rid, random_prompt(rng, 40), greedy(30), mode=mode)
    engine.step()
    engine.step()
    assert engine.stats().held == 1 and engine.stats().prefilled == 1
    assert engine.abort("r") and engine.abort("h") and engine.abort("p")
    assert not engine.abort("r") and not engine.abort("unknown")
    engine.release("unknown")
    engine.release("w")  # release does not stop a generating request
    assert "w" in engine.seqs
    engine.add_request("w2", random_prompt(rng, 10), greedy(3))
    engine.abort("w2")  # still waiting
    outs = run_all(engine)
    assert set(outs) == {"w"} and [o.index for o in outs["w"]] == list(range(2, 30))
    assert outs["w"][-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().used_blocks == 0
