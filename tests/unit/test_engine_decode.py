"""Paged, batched, chunked computation against the dense reference; extend vs decode steps."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine import FinishReason, InvalidRequestError, Mode, SamplingParams
from shared.engine.outputs import group_by_request
from tests.engine_util import dense_greedy, greedy, make_engine, random_prompt, run_all, tokens_of

KV_ATOL = 1e-5  # fp32: the extend pass and single decode steps round differently, nothing more
LOGIT_ATOL = 1e-4


def test_batched_paged_decode_equals_dense_reference():
    # Chunked prefill (32 tokens per step) joins running decodes; blocks of 16 tokens.
    engine = make_engine(max_batched_tokens=32)
    rng = random.Random(0)
    prompts = [random_prompt(rng, n) for n in (1, 5, 16, 17, 31, 48, 70, 100)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(64))
    outs = run_all(engine)
    for i, p in enumerate(prompts):
        got = outs[f"r{i}"]
        assert [o.index for o in got] == list(range(64))
        assert got[-1].finished and got[-1].finish_reason is FinishReason.LENGTH
        assert tokens_of(got) == dense_greedy(engine, p, 64), f"prompt {i} (len {len(p)}) diverged"
    assert engine.stats().used_blocks == 0  # everything freed, prefix blocks stay cached


def test_requests_join_a_running_batch():
    engine = make_engine()
    rng = random.Random(1)
    first, second = random_prompt(rng, 20), random_prompt(rng, 33)
    engine.add_request("a", first, greedy(30))
    outs = [o for _ in range(5) for o in engine.step()]
    engine.add_request("b", second, greedy(10))
    joined = engine.step()  # one forward: b's prefill and a's decode
    assert {o.rid for o in joined} == {"a", "b"}
    outs += joined
    for rest in run_all(engine).values():
        outs += rest
    by_rid = group_by_request(outs)
    for rid, prompt, n in (("a", first, 30), ("b", second, 10)):
        assert [o.index for o in by_rid[rid]] == list(range(n)), rid
        assert tokens_of(by_rid[rid]) == dense_greedy(engine, prompt, n), rid


def _seq_kv(engine, rid: str, start: int, stop: int) -> torch.Tensor:
    seq = engine.seqs[rid]
    bs = engine.block_size
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(start, stop)])
    L, _, nb, _, kvh, d = engine.kv_cache.shape
    return engine.kv_cache.view(L, 2, nb * bs, kvh, d)[:, :, slots]


def test_extend_equals_single_decode_steps():
    rng = random.Random(2)
    prompt = random_prompt(rng, 37)
    k = 23
    follow = dense_greedy(make_engine(), prompt, k + 1)
    one, many = make_engine(), make_engine()
    for e in (one, many):
        e.add_request("r", prompt, greedy(64), mode=Mode.HOLD)
        assert [o.computed for o in run_all(e)["r"]] == [True]
    one.extend("r", follow[:k], final=False)  # one forward over k tokens
    assert [(o.token_id, o.computed) for o in run_all(one)["r"]] == [(None, True)]
    for t in follow[:k]:  # k single-token forwards
        many.extend("r", [t], final=False)
        run_all(many)
    n = len(prompt) + k
    kv_one, kv_many = _seq_kv(one, "r", 0, n), _seq_kv(many, "r", 0, n)
    assert (kv_one - kv_many).abs().max().item() <= KV_ATOL
    lo, lm = one.seqs["r"].last_logits, many.seqs["r"].last_logits
    assert (lo - lm).abs().max().item() <= LOGIT_ATOL
    assert (lo - one.model.dense_logits(prompt + follow[:k])[-1]).abs().max().item() <= LOGIT_ATOL
    # final=True with no new tokens samples from the kept logits, then decodes on.
    one.extend("r", [], final=True)
    out = run_all(one)["r"]
    assert out[0].token_id == follow[k] and out[0].index == k
    assert [o.index for o in out] == list(range(k, 64))


def test_prefill_mode_streams_blocks_chunk_by_chunk():
    engine = make_engine(max_batched_tokens=32)
    prompt = random_prompt(random.Random(3), 100)
    engine.add_request("p", prompt, SamplingParams(max_tokens=50), mode=Mode.PREFILL)
    seen = []
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        seen.append(len(engine.computed_block_hashes("p")))
    assert seen == [2, 4, 6, 6]  # 32 tokens per step; the 4th step finishes 4 tokens
    assert engine.computed_block_hashes("p") == engine.block_hashes(prompt)
    (o,) = outs
    assert (o.finished, o.finish_reason, o.index) == (True, FinishReason.PREFILLED, 0)
    assert o.token_id == dense_greedy(engine, prompt, 1)[0]
    assert engine.stats().prefilled == 1 and engine.stats().used_blocks == 7
    engine.release("p")
    assert engine.stats().used_blocks == 0 and engine.computed_block_hashes("p") == []


def test_prompts_waiting_together_share_a_forward_chunk_by_chunk():
    engine = make_engine(max_batched_tokens=96, chunk_tokens=32)
    rng = random.Random(6)
    prompts = {rid: random_prompt(rng, 40) for rid in "abc"}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=5), mode=Mode.PREFILL)
    assert engine.step() == []  # 32 tokens of each: no prompt is done, all three advanced
    assert [len(engine.computed_block_hashes(rid)) for rid in prompts] == [2, 2, 2]
    outs = engine.step()  # the last 8 of each
    assert sorted(o.rid for o in outs) == ["a", "b", "c"] and not engine.has_unfinished()
    for o in outs:
        assert o.finish_reason is FinishReason.PREFILLED
        assert o.token_id == dense_greedy(engine, prompts[o.rid], 1)[0]


def test_hold_waits_without_compute_then_generates():
    engine = make_engine()
    prompt = random_prompt(random.Random(4), 30)
    ref = dense_greedy(engine, prompt, 12)
    engine.add_request("h", prompt + ref[:1], greedy(12), num_prompt_tokens=len(prompt), mode=Mode.HOLD)
    assert [o.computed for o in run_all(engine)["h"]] == [True]
    assert not engine.has_unfinished() and engine.step() == [] and engine.stats().held == 1
    computed = engine.stats().computed_tokens
    engine.extend("h", ref[1:4], final=False)
    assert [o.computed for o in run_all(engine)["h"]] == [True]
    assert engine.stats().computed_tokens == computed + 3
    engine.extend("h", ref[4:6], final=True)
    out = run_all(engine)["h"]
    assert [o.index for o in out] == list(range(6, 12))
    assert tokens_of(out) == ref[6:] and out[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidRequestError):  # finished requests are forgotten
        engine.generated_token_ids("h")


def test_decodes_are_not_stalled_by_a_long_chunk():
    engine = make_engine(max_batched_tokens=16)
    rng = random.Random(5)
    engine.add_request("old", random_prompt(rng, 10), greedy(100), mode=Mode.HOLD)
    run_all(engine)
    engine.add_request("new", random_prompt(rng, 5), greedy(20))
    engine.step()
    engine.extend("old", random_prompt(rng, 64), final=True)  # older, 64 tokens to compute
    for _ in range(5):  # the 64-token extend is chunked behind the running decode
        assert "new" in {o.rid for o in engine.step()}
