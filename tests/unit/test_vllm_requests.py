"""A pdd request as vLLM requests, and vLLM's outputs as pdd's (shared/vllm/requests.py), and
the seam's block calls over the in-memory store (shared/vllm/store_calls.py): no vLLM needed."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from shared.engine import EngineError, FinishReason, Mode, SamplingParams
from shared.engine.kv_admission import Verdict
from shared.engine.seam import BlockFormat
from shared.vllm.memory_store import MemoryStore
from shared.vllm.requests import (
    Logprobs,
    Next,
    VllmRequest,
    first_token_ends,
    on_output,
    output_budget,
    token_logprobs,
)
from shared.vllm.store_calls import StoreCalls

MAX_LEN = 1000


def request(mode: Mode, tokens: int = 10, prompt: int = 10, max_tokens: int = 8) -> VllmRequest:
    req = VllmRequest("r", list(range(tokens)), prompt, SamplingParams(max_tokens=max_tokens), mode, [])
    req.running, req.running_mode, req.sent = "r@0", mode, tokens
    return req


def test_generate_outputs_are_indexed_from_the_first_generated_token() -> None:
    req = request(Mode.GENERATE, tokens=12, prompt=10)  # two output tokens came from elsewhere
    outs, then = on_output(req, [7, 8], False, None, MAX_LEN)
    assert [(o.token_id, o.index, o.finished) for o in outs] == [(7, 2, False), (8, 3, False)]
    assert then is Next.WAIT and req.tokens[-2:] == [7, 8]
    outs, then = on_output(req, [9], True, "length", MAX_LEN)
    assert (outs[0].index, outs[0].finish_reason, then) == (4, FinishReason.LENGTH, Next.FORGET)
    req = request(Mode.GENERATE)
    outs, _ = on_output(req, [], True, "stop", MAX_LEN)  # a stop string ended it on the last delta
    assert [(o.token_id, o.finish_reason) for o in outs] == [(None, FinishReason.STOP)]


def test_prefill_keeps_its_first_token_and_says_whether_it_ends() -> None:
    req = request(Mode.PREFILL)
    (out,), then = on_output(req, [42], True, "length", MAX_LEN)  # vLLM was asked one token
    assert (out.token_id, out.index, out.finish_reason, out.ends) == (42, 0, FinishReason.PREFILLED, None)
    assert then is Next.WAIT and req.prefilled and req.running is None
    assert first_token_ends(request(Mode.PREFILL, max_tokens=1), "length", MAX_LEN) is FinishReason.LENGTH
    assert first_token_ends(request(Mode.PREFILL), "stop", MAX_LEN) is FinishReason.STOP
    assert first_token_ends(request(Mode.PREFILL, tokens=MAX_LEN), "length", MAX_LEN) is FinishReason.LENGTH


def test_a_hold_batch_is_computed_its_token_dropped_and_later_tokens_resubmitted() -> None:
    req = request(Mode.HOLD)
    outs, then = on_output(req, [5], True, "length", MAX_LEN)
    assert [(o.computed, o.token_id) for o in outs] == [(True, None)] and then is Next.WAIT
    assert req.tokens == list(range(10))  # vLLM's token is not the relay's
    req = request(Mode.HOLD)
    req.tokens += [11, 12]  # extend() while the batch ran
    assert on_output(req, [5], True, "length", MAX_LEN) == ([], Next.SUBMIT)
    req = request(Mode.HOLD)
    req.mode = Mode.GENERATE  # the final extend came, with no tokens
    assert on_output(req, [5], True, "length", MAX_LEN) == ([], Next.SUBMIT)


def test_an_aborted_vllm_request_ends_the_request() -> None:
    outs, then = on_output(request(Mode.GENERATE), [], True, "abort", MAX_LEN)
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, FinishReason.ABORT)]
    assert then is Next.FORGET


class Lp(NamedTuple):  # vLLM's Logprob, as far as the translation reads it
    logprob: float
    rank: int | None


def test_vllms_logprobs_become_pdds() -> None:
    # the sampled token 9 ranks 3rd; vLLM also lists the top 2
    entry = {4: Lp(-0.1, 1), 7: Lp(-2.5, 2), 9: Lp(-3.0, 3)}
    lp = token_logprobs(entry, 9, 2)
    assert (lp.logprob, lp.top_ids, lp.top_logprobs, lp.rank) == (-3.0, [4, 7], [-0.1, -2.5], 3)
    req = request(Mode.GENERATE)
    req.params.logprobs = 2
    outs, _ = on_output(req, [9], False, None, MAX_LEN, Logprobs([entry]))
    assert outs[0].logprobs == lp
    req = request(Mode.PREFILL, tokens=3, prompt=3)
    req.params.prompt_logprobs = 1
    prompt = [None, {1: Lp(-1.0, 1)}, {2: Lp(-2.0, 2), 5: Lp(-0.5, 1)}]
    (out,), _ = on_output(req, [4], True, "length", MAX_LEN, Logprobs([entry], prompt))
    assert out.logprobs is None  # not asked for
    assert [(p.logprob, p.top_ids, p.rank) for p in out.prompt_logprobs] == [(-1.0, [1], 1), (-2.0, [5], 2)]


def test_output_budget() -> None:
    assert output_budget(request(Mode.GENERATE, tokens=995), 16, 4, MAX_LEN) == (5, 4)
    assert output_budget(request(Mode.PREFILL), 16, 4, MAX_LEN) == (1, 1)
    assert output_budget(request(Mode.HOLD), 16, 0, MAX_LEN) == (1, 0)


class Blocks(StoreCalls):
    def __init__(self, capacity: int) -> None:
        self.store = MemoryStore(capacity)
        self.dtype = torch.float32
        self._format = BlockFormat(torch.float32, (2, 2, 16, 1, 4))


def kv(n: int, x: float = 1.0) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).view(1, 1, n, 1, 1, 1).expand(2, 2, n, 16, 1, 4) + x


def test_blocks_import_export_and_pins() -> None:
    b = Blocks(4)
    assert b.import_blocks([1, 2, 3], kv(3), pin="a") == 3
    assert torch.equal(b.export_blocks([3, 1]), kv(3)[:, :, [2, 0]])
    assert b.import_blocks([1, 2], kv(2)) == 0
    with pytest.raises(EngineError, match="does not hold"):
        b.import_blocks([9], kv(2))
    with pytest.raises(EngineError, match="not cached"):
        b.export_blocks([9])
    assert b.reserve("b", [1, 2, 7], 3) == (Verdict.ADMIT, 2)
    assert b.reserve("c", [1], 5) == (Verdict.NEVER, 0)
    assert b.share("b", [3, 8]) == [3]
    assert b.num_pin_owners() == 2
    b.unpin("a")
    b.unpin("b")
    assert b.num_pin_owners() == 0 and b.store.pinned_blocks == 0
    assert [e for e, _ in b.drain_block_events()] == ["stored"] * 3 and sorted(b.cached_hashes()) == [1, 2, 3]
    with pytest.raises(EngineError, match="RDMA"):
        b.take_spare("a", 1)
