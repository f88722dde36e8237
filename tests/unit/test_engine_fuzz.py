"""Random interleavings of every engine call on a tight pool: no crash, no leak, no hang,
and every greedy request that completes matches the dense reference."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shared.engine import EngineError, FinishReason, InvalidRequestError, Mode
from shared.engine.block_pool import NO_HASH
from tests.engine_util import dense_greedy, greedy, make_engine, random_prompt

TIGHT_MB = 20 * 16 * 512 / 2**20  # 20 blocks of 16 tokens


def _check_invariants(engine) -> None:
    refs: Counter[int] = Counter()
    for seq in engine.seqs.values():
        refs.update(seq.block_table)
    for bids in engine.exchange.pins.values():
        refs.update(bids)
    for block in engine.pool.blocks:
        assert block.ref_count == refs[block.block_id], f"block {block.block_id} refcount"
        assert (block.ref_count == 0) == (block.block_id in engine.pool.free)
        if block.hash != NO_HASH:
            assert engine.pool.block_of(block.hash) == block.block_id
    assert engine.pool.num_cached == sum(b.hash != NO_HASH for b in engine.pool.blocks)


verified = {"n": 0}


def _step(engine, expected, got) -> None:
    for o in engine.step():
        assert o.finish_reason is not FinishReason.ERROR, o.error
        if o.rid not in expected:
            continue
        if o.token_id is not None:
            got.setdefault(o.rid, []).append(o.token_id)
        if o.finished:
            prompt, n = expected.pop(o.rid)
            assert o.finish_reason is FinishReason.LENGTH
            assert got[o.rid] == dense_greedy(engine, prompt, n), f"{o.rid} diverged"
            verified["n"] += 1
    _check_invariants(engine)


@pytest.mark.parametrize("seed", range(3))
def test_random_interleavings(seed):
    rng = random.Random(seed)
    verified["n"] = 0
    engine, donor = make_engine(TIGHT_MB, max_batched_tokens=48), make_engine()
    prefixes = [random_prompt(rng, 32) for _ in range(3)]  # shared prefixes -> cache hits
    expected: dict[str, tuple[list[int], int]] = {}
    got: dict[str, list[int]] = {}
    live: list[str] = []
    for step in range(150):
        op = rng.random()
        rid = f"r{step}"
        try:
            if op < 0.25:
                prompt = rng.choice(prefixes)[: rng.randint(1, 32)] + random_prompt(rng, rng.randint(0, 40))
                n = rng.randint(1, 30)
                mode = rng.choice([Mode.GENERATE, Mode.GENERATE, Mode.PREFILL, Mode.HOLD])
                engine.add_request(rid, prompt, greedy(n), mode=mode)
                live.append(rid)
                if mode is Mode.GENERATE:
                    expected[rid] = (prompt, n)
            elif op < 0.32 and live:
                victim = rng.choice(live)
                engine.abort(victim)
                expected.pop(victim, None)
            elif op < 0.38 and live:
                engine.release(rng.choice(live))
            elif op < 0.45 and live:
                engine.extend(
                    rng.choice(live), random_prompt(rng, rng.randint(0, 5)), final=rng.random() < 0.5
                )
            elif op < 0.52:
                prompt = rng.choice(prefixes) + random_prompt(rng, 16)
                hashes = donor.block_hashes(prompt)
                if donor.exchange.num_cached_prefix_blocks(hashes) < len(hashes):
                    donor.add_request(rid, prompt, greedy(1))
                    while donor.has_unfinished():
                        donor.step()
                engine.exchange.import_blocks(
                    hashes, donor.exchange.export_blocks(hashes), pin=rng.choice([None, f"pin{step}"])
                )
            elif op < 0.56:
                engine.exchange.pin_blocks(f"pin{step}", engine.block_hashes(rng.choice(prefixes)))
            elif op < 0.6:
                engine.exchange.unpin(f"pin{rng.randrange(max(step, 1))}")
        except InvalidRequestError:
            pass  # e.g. extend of a request that is not held, or a prompt too big for the pool
        except EngineError as e:
            assert "no free KV block" in str(e)  # a full pool refuses imports
        _step(engine, expected, got)
    # Let go of everything that holds blocks; what is left must run to the end.
    for owner in list(engine.exchange.pins):
        engine.exchange.unpin(owner)
    for rid in list(engine.seqs):
        engine.release(rid)
    for _ in range(500):
        if not engine.has_unfinished():
            break
        _step(engine, expected, got)
    assert not expected, f"{len(expected)} requests never finished"
    assert verified["n"] >= 5
    assert engine.stats().used_blocks == 0
    assert not engine.has_unfinished()
