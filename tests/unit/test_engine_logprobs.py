"""Logprobs from the engine: fp32 log_softmax of the raw logits of the step that produced each
token (before temperature / top-k / top-p), and the prompt's for echo, even where the prefix
cache would have skipped computing it."""

from __future__ import annotations

import pytest
import torch

from shared.bus.codec import decode, encode
from shared.bus.messages import Role, TokenEvent
from shared.engine import InvalidRequestError, SamplingParams
from shared.engine.logprobs import TokenLogprobs, logprobs_of, sampled_logprobs

from ..engine_util import greedy, make_engine, run_all

TOL = 1e-4  # paged engine vs dense reference forward: fp32 sums in another order


def dense_logprobs(engine, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(engine.model.dense_logits(ids).float(), dim=-1)


def test_logprobs_of_gives_the_chosen_token_and_the_best_first():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    lps = logprobs_of(logits, [0, 3], top_k=2)
    ref = torch.log_softmax(logits, dim=-1)
    assert lps[0] == TokenLogprobs(ref[0, 0].item(), [1, 2], [ref[0, 1].item(), ref[0, 2].item()], rank=3)
    assert lps[1].logprob == ref[1, 3].item() and lps[1].top_ids == [2, 3] and lps[1].rank == 2
    assert logprobs_of(logits, [1, 2], top_k=0)[0].top_ids == []  # logprobs=0: the chosen token only


def test_sampled_logprobs_only_for_rows_that_asked():
    logits = torch.randn(3, 10)
    out = sampled_logprobs(logits, [1, 2, 3], [None, 4, 0])
    assert out[0] is None and len(out[1].top_ids) == 4 and out[2].top_ids == []
    assert out[1] == logprobs_of(logits[1:2], [2], 4)[0]  # a row's values do not depend on the others


def test_generated_logprobs_are_the_raw_distribution_not_the_tempered_one():
    engine = make_engine()
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=1.8, top_k=5, seed=7, max_tokens=6, ignore_eos=True, logprobs=3)
    engine.add_request("r", prompt, params)
    outs = run_all(engine)["r"]
    toks = [o.token_id for o in outs]
    dense = dense_logprobs(engine, prompt + toks)
    for i, o in enumerate(outs):
        row = dense[len(prompt) - 1 + i]
        assert abs(o.logprobs.logprob - row[o.token_id].item()) < TOL
        assert o.logprobs.top_ids == row.topk(3).indices.tolist()
        assert (
            max(abs(a - b) for a, b in zip(o.logprobs.top_logprobs, row.topk(3).values.tolist(), strict=True))
            < TOL
        )


def test_prompt_logprobs_across_chunks_and_despite_a_cached_prefix():
    engine = make_engine(max_batched_tokens=16)  # the prompt is computed in 4 chunks
    prompt = [(i * 11 + 5) % 256 for i in range(50)]
    run_all_of(engine, "warm", prompt, greedy(2))  # its full blocks are in the prefix cache now
    outs = run_all_of(engine, "echo", prompt, greedy(3, logprobs=2, prompt_logprobs=2))
    prompt_lps = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])  # they come with output 0 only
    assert len(prompt_lps) == len(prompt) - 1  # every prompt token but the first
    dense = dense_logprobs(engine, prompt)
    for p, lp in enumerate(prompt_lps):
        assert abs(lp.logprob - dense[p, prompt[p + 1]].item()) < TOL
        assert lp.top_ids == dense[p].topk(2).indices.tolist()


def test_nothing_extra_unless_asked_and_no_prompt_logprobs_for_a_continuation():
    engine = make_engine()
    prompt = list(range(10, 30))
    plain = run_all_of(engine, "plain", prompt, greedy(3))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)
    # A request taken over after output 0 (relay, MD, resume) samples output 1 first: its
    # prompt logprobs went to the client with output 0 already.
    engine.add_request(
        "cont",
        prompt + [plain[0].token_id],
        greedy(3, logprobs=1, prompt_logprobs=1),
        num_prompt_tokens=len(prompt),
    )
    outs = run_all(engine)["cont"]
    assert outs[0].index == 1 and outs[0].prompt_logprobs is None and outs[0].logprobs is not None


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [21, -1, True, 2.0])
def test_logprob_counts_out_of_range_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validate()


def test_token_event_carries_logprobs_on_the_wire():
    lps = [TokenLogprobs(-0.25, [3, 9], [-0.25, -1.5]), TokenLogprobs(-3.0)]
    ev = TokenEvent(
        "r", Role.RELAY, 4, [3, 7], logprobs=lps, prompt_logprobs=[TokenLogprobs(-2.0, [1], [-0.5])]
    )
    assert decode(TokenEvent, encode(ev)) == ev
    plain = TokenEvent("r", Role.RELAY, 4, [3, 7])
    assert decode(TokenEvent, encode(plain)).logprobs is None
    params = SamplingParams(logprobs=5, prompt_logprobs=5)  # every role gets the counts with the params
    assert SamplingParams.from_dict(params.to_dict()) == params


def run_all_of(engine, rid: str, prompt: list[int], params: SamplingParams) -> list:
    engine.add_request(rid, prompt, params)
    return run_all(engine)[rid]
