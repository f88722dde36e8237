"""KV export/import by block hash, and the prefill -> (relay) -> main decode flows."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine import EngineError, FinishReason, Mode, SamplingParams
from tests.engine_util import greedy, make_engine, random_prompt, run_all, tokens_of


def _prefill(engine, rid, prompt, params):
    """Prefill service: mode=prefill, first token, KV of the computed full blocks."""
    engine.add_request(rid, prompt, params, mode=Mode.PREFILL)
    (out,) = run_all(engine)[rid]
    assert out.finish_reason is FinishReason.PREFILLED and out.index == 0
    hashes = engine.computed_block_hashes(rid)
    return out.token_id, hashes, engine.exchange.export_blocks(hashes)


def _one_engine(prompt, params, rid="ref"):
    engine = make_engine()
    engine.add_request(rid, prompt, params)
    return tokens_of(run_all(engine)[rid])


def test_export_import_continuation_matches():
    prompt = random_prompt(random.Random(20), 75)
    a, b = make_engine(), make_engine()
    a.add_request("x", prompt, greedy(30))
    exporter_tokens = tokens_of(run_all(a)["x"])
    hashes = a.block_hashes(prompt)
    kv = a.exchange.export_blocks(hashes)
    assert kv.shape == (2, 2, 4, 16, 2, 16) and kv.is_contiguous() and kv.device.type == "cpu"
    assert b.exchange.import_blocks(hashes, kv) == 4
    assert b.exchange.num_cached_prefix_blocks(hashes) == 4
    b.add_request("x", prompt, greedy(30))
    assert tokens_of(run_all(b)["x"]) == exporter_tokens
    assert b.stats().prefix_hit_tokens == 64
    assert torch.equal(b.exchange.export_blocks(hashes), kv)


def test_import_only_missing_blocks_composes_with_cache():
    rng = random.Random(21)
    shared_prefix = random_prompt(rng, 32)
    prompt = shared_prefix + random_prompt(rng, 50)
    a, b = make_engine(), make_engine()
    b.add_request("warm", shared_prefix + random_prompt(rng, 5), greedy(3))  # B caches 2 blocks itself
    run_all(b)
    b.exchange.drain_events()
    a.add_request("x", prompt, greedy(25))
    ref = tokens_of(run_all(a)["x"])
    hashes = a.block_hashes(prompt)
    have = b.exchange.num_cached_prefix_blocks(hashes)
    assert have == 2
    assert b.exchange.import_blocks(hashes[have:], a.exchange.export_blocks(hashes[have:])) == 3
    assert b.exchange.import_blocks(hashes, a.exchange.export_blocks(hashes)) == 0  # all present: skipped
    assert b.exchange.drain_events() == [("stored", h) for h in hashes[have:]]
    b.add_request("x", prompt, greedy(25))
    assert tokens_of(run_all(b)["x"]) == ref
    assert b.stats().prefix_hit_tokens == 80


def test_pd_flow_generate_equals_single_engine():
    prompt = random_prompt(random.Random(22), 70)
    params = greedy(40)
    ref = _one_engine(prompt, params)
    p, md = make_engine(), make_engine()
    first, hashes, kv = _prefill(p, "r", prompt, params)
    assert hashes == p.block_hashes(prompt)
    md.exchange.import_blocks(hashes, kv, pin="r")
    md.add_request("r", prompt + [first], params, num_prompt_tokens=len(prompt))
    md.exchange.unpin("r")
    p.release("r")
    outs = run_all(md)["r"]
    assert [o.index for o in outs] == list(range(1, 40))
    assert [first] + tokens_of(outs) == ref


def test_pd_flow_relay_then_hold_and_extend_equals_single_engine():
    prompt = random_prompt(random.Random(23), 90)
    params = greedy(50)
    ref = _one_engine(prompt, params)
    p, rld, md = make_engine(), make_engine(), make_engine()
    first, hashes, kv = _prefill(p, "r", prompt, params)
    # Relay: import over the local path, decode eagerly.
    rld.exchange.import_blocks(hashes, kv, pin="r")
    rld.add_request("r", prompt + [first], params, num_prompt_tokens=len(prompt))
    rld.exchange.unpin("r")
    merged = {0: first}
    for _ in range(12):
        for o in rld.step():
            merged[o.index] = o.token_id
    # Main decode: KV arrives over the WAN; it holds the prompt while the relay runs.
    md.exchange.import_blocks(hashes, kv, pin="r")
    md.add_request("r", prompt + [first], params, num_prompt_tokens=len(prompt), mode=Mode.HOLD)
    assert [o.computed for o in run_all(md)["r"]] == [True]
    catch_up = rld.generated_token_ids("r")[1:]
    md.extend("r", catch_up, final=False)  # catch-up batch
    assert [o.computed for o in run_all(md)["r"]] == [True]
    for _ in range(5):  # the relay keeps going meanwhile
        for o in rld.step():
            merged[o.index] = o.token_id
    rest = rld.generated_token_ids("r")[1 + len(catch_up) :]
    assert rld.abort("r") and not rld.abort("r")
    md.extend("r", rest, final=True)  # one-shot remainder; MD samples and continues
    md.exchange.unpin("r")
    for o in run_all(md)["r"]:
        assert o.index not in merged
        merged[o.index] = o.token_id
    assert sorted(merged) == list(range(50))
    assert [merged[i] for i in range(50)] == ref


def test_seeded_sampling_survives_a_move_between_engines():
    prompt = random_prompt(random.Random(24), 40)
    params = SamplingParams(temperature=1.5, top_p=0.95, top_k=50, max_tokens=40, seed=1234, ignore_eos=True)
    ref = _one_engine(prompt, params)
    assert ref != _one_engine(prompt, greedy(40))  # really sampling
    other = SamplingParams(**{**params.to_dict(), "seed": 99})
    assert ref != _one_engine(prompt, other)  # and the seed matters
    a, b = make_engine(), make_engine()
    a.add_request("r", prompt, params)
    got: list[int] = []
    while len(got) < 13:
        got += [o.token_id for o in a.step()]
    generated = a.generated_token_ids("r")
    hashes = a.computed_block_hashes("r")
    b.exchange.import_blocks(hashes, a.exchange.export_blocks(hashes))
    a.abort("r")
    b.add_request("r", prompt + generated, params, num_prompt_tokens=len(prompt))
    outs = run_all(b)["r"]
    assert outs[0].index == len(generated)
    assert generated + tokens_of(outs) == ref


def test_import_and_export_errors():
    a, b = make_engine(), make_engine(kv_memory_mb=4 * 16 * 512 / 2**20)
    prompt = random_prompt(random.Random(25), 100)
    a.add_request("x", prompt, greedy(2))
    run_all(a)
    hashes = a.block_hashes(prompt)
    kv = a.exchange.export_blocks(hashes)
    with pytest.raises(EngineError, match="not cached"):
        a.exchange.export_blocks([12345])
    with pytest.raises(EngineError, match="shape"):
        b.exchange.import_blocks(hashes[:2], kv)
    with pytest.raises(EngineError, match="dtype"):
        b.exchange.import_blocks(hashes, kv.half())
    with pytest.raises(EngineError, match="no free KV block"):
        b.exchange.import_blocks(hashes, kv)  # 6 blocks into a pool of 4
    assert b.stats().cached_blocks == 0  # all or nothing
    assert b.exchange.import_blocks(hashes[:4], kv[:, :, :4].contiguous(), pin="o") == 4
    assert b.stats().free_blocks == 0 and b.stats().pinned_blocks == 4
    b.add_request("y", random_prompt(random.Random(26), 20), greedy(2))
    assert b.step() == []  # pinned blocks cannot be evicted: it waits
    b.exchange.unpin("o")
    assert len(run_all(b)["y"]) == 2


def test_pin_blocks_protects_from_eviction():
    engine = make_engine(kv_memory_mb=8 * 16 * 512 / 2**20)
    rng = random.Random(27)
    prompt = random_prompt(rng, 64)
    engine.add_request("a", prompt, greedy(2))
    run_all(engine)
    hashes = engine.block_hashes(prompt)
    assert engine.exchange.pin_blocks("owner", hashes + [777]) == 4
    for i in range(3):  # churn through the 4 unpinned blocks
        engine.add_request(f"c{i}", random_prompt(rng, 40), greedy(5))
        run_all(engine)
    assert engine.exchange.num_cached_prefix_blocks(hashes) == 4
    engine.exchange.unpin("owner")
    assert engine.stats().pinned_blocks == 0


def test_pins_are_their_own_namespace():
    """A request and a pin may share an id: dropping the request leaves the pin alone."""
    engine = make_engine()
    rng = random.Random(28)
    prompt = random_prompt(rng, 64)
    engine.add_request("r", prompt, greedy(2))
    run_all(engine)
    hashes = engine.block_hashes(prompt)
    assert engine.exchange.pin_blocks("r", hashes) == 4
    for mode in (Mode.HOLD, Mode.PREFILL, Mode.GENERATE):
        engine.add_request("r", prompt + random_prompt(rng, 5), greedy(3), mode=mode)
        engine.step()
        engine.release("r")
        engine.abort("r")
        assert "r" not in engine.seqs
        assert engine.stats().pinned_blocks == 4 and engine.stats().used_blocks == 4
    engine.exchange.unpin("r")
    engine.exchange.unpin("r")  # nothing left: a no-op
    assert engine.stats().pinned_blocks == 0 and engine.stats().used_blocks == 0
    assert engine.exchange.num_cached_prefix_blocks(hashes) == 4  # unpinned, still cached
