"""VllmEngine (shared/vllm/engine.py) through the engine seam alone, as prefill, relay and main
decode use it: one vLLM engine of the `small` preset (vLLM keeps one KV connector per process)
plays P, then forgets every cached block (`forget_cached`: vLLM's prefix cache and its store)
and plays MD, importing P's blocks. Greedy tokens equal vLLM's own, and afterwards nothing is
held: no pin, no block of vLLM's paged cache in use.

Runs only where vLLM imports (`make test-vllm`)."""

from __future__ import annotations

import random

import pytest

from tests.vllm.needs_vllm import needs_vllm

pytestmark = needs_vllm

KV_GIB = 0.25  # the store's room: 1024 blocks of the small preset (256 KiB each)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def engine():
    from shared.config import EngineSettings, ModelSettings
    from shared.engine.factory import build_engine

    return build_engine(ModelSettings(preset="small"), EngineSettings(kind="vllm", kv_cache_space_gib=KV_GIB))


@pytest.fixture
def engines(engine):
    """(P, MD): the one engine in both roles, starting from an empty cache."""
    engine.forget_cached()
    return engine, engine


def greedy(n: int):
    from shared.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


def run_all(engine) -> dict:
    from tests.engine_util import run_all as steps

    return steps(engine)


def tokens_of(outs) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


def alone(engine, prompt: list[int], n: int) -> list[int]:
    rid = f"alone-{len(prompt)}-{n}-{prompt[0]}"
    engine.add_request(rid, prompt, greedy(n))
    return tokens_of(run_all(engine)[rid])


def idle(engine) -> bool:
    return engine.num_requests() == 0 and engine.num_pin_owners() == 0 and engine.stats().used_blocks == 0


def test_identity_and_limits(engines) -> None:
    from shared.engine.seam import Engine

    p, _ = engines
    assert isinstance(p, Engine)
    assert p.block_size == 16 and p.model_id == "small-s0" and p.max_model_len >= 1024
    fmt = p.block_format()
    assert fmt.shape == (8, 2, 16, 4, 64)
    stats = p.stats()
    assert stats.num_blocks == int(KV_GIB * 2**30) // (16 * 16384) and stats.kv_bytes_per_token == 16384
    assert p.lifetime_blocks(40, greedy(24)) == 4
    assert idle(p) and not p.has_unfinished()


def test_prefill_export_import_decode_equals_one_engine(engines) -> None:
    from shared.engine import FinishReason, Mode

    p, d = engines
    prompt = prompt_of(2, 300)
    p.add_request("r", prompt, greedy(20), mode=Mode.PREFILL)
    (out,) = run_all(p)["r"]
    assert out.finish_reason is FinishReason.PREFILLED and out.index == 0 and out.ends is None
    hashes = p.computed_block_hashes("r")
    assert hashes == p.block_hashes(prompt) and len(hashes) == 18  # the partial last vLLM block's too
    kv = p.export_blocks(hashes)
    assert tuple(kv.shape) == (8, 2, 18, 16, 4, 64) and kv.device.type == "cpu"

    assert p.abort("r") and not p.abort("r")
    ref = alone(p, prompt, 20)
    d.forget_cached()  # P's blocks are gone: MD has only what it imports
    assert d.import_blocks(hashes, kv, pin="r") == 18
    assert d.import_blocks(hashes, kv) == 0  # held already: idempotent by hash
    before = d.stats().prefix_hit_tokens
    d.add_request("r", prompt + [out.token_id], greedy(20), num_prompt_tokens=len(prompt))
    d.unpin("r")
    outs = run_all(d)["r"]
    assert [o.index for o in outs] == list(range(1, 20)) and outs[-1].finish_reason is FinishReason.LENGTH
    # the whole vLLM blocks of the imported pdd blocks came from the store (all 18: 288 tokens)
    assert d.stats().prefix_hit_tokens - before == 288
    assert [out.token_id, *tokens_of(outs)] == ref
    assert idle(p) and idle(d)


def test_extend_by_token_ids_continues_as_one_engine(engines) -> None:
    from shared.engine import Mode

    p, md = engines
    prompt = prompt_of(3, 137)
    ref = alone(p, prompt, 16)
    md.forget_cached()
    md.add_request("r", prompt + ref[:3], greedy(16), num_prompt_tokens=len(prompt), mode=Mode.HOLD)
    assert [(o.computed, o.token_id) for o in run_all(md)["r"]] == [(True, None)]
    md.extend("r", ref[3:6], final=False)
    assert [(o.computed, o.token_id) for o in run_all(md)["r"]] == [(True, None)]
    assert md.generated_token_ids("r") == ref[:6]
    md.extend("r", ref[6:8], final=True)
    outs = run_all(md)["r"]
    assert outs[0].index == 8 and tokens_of(outs) == ref[8:]
    assert idle(md)


def test_abort_frees_vllms_blocks_and_the_prefills_pins(engines) -> None:
    from shared.engine import EngineError, Mode

    p, _ = engines
    p.add_request("a", prompt_of(4, 200), greedy(200))
    p.add_request("p", prompt_of(5, 100), greedy(5), mode=Mode.PREFILL)
    for _ in range(4):
        p.step()
    assert p.stats().used_blocks > 0 and p.num_requests() == 2
    assert p.abort("a") and p.abort("p")
    assert not p.abort("never")
    for _ in range(3):  # vLLM frees an aborted request's blocks at its next step
        p.step()
    assert idle(p)
    with pytest.raises(EngineError):
        p.generated_token_ids("a")


def test_pins_and_reservations_hold_blocks_until_unpin(engines) -> None:
    from shared.engine.kv_admission import Verdict

    p, md = engines
    prompt = prompt_of(6, 64)
    p.add_request("src", prompt, greedy(4))
    run_all(p)
    hashes = p.block_hashes(prompt)
    kv = p.export_blocks(hashes)  # a finished request's blocks stay in the store
    md.forget_cached()
    assert md.reserve("a", hashes, md.lifetime_blocks(len(prompt), greedy(4))) == (Verdict.ADMIT, 0)
    assert md.reserve("x", hashes, 10**9) == (Verdict.NEVER, 0)
    assert md.import_blocks(hashes[:2], kv[:, :, :2], pin="a") == 2
    assert md.reserve("b", hashes, 5) == (Verdict.ADMIT, 2)
    assert md.import_blocks(hashes[2:], kv[:, :, 2:], pin="b") == 2
    assert md.share("a", hashes[2:]) == hashes[2:]
    assert md.num_pin_owners() == 2 and md.stats().pinned_blocks == 4
    for owner in ("a", "b", "x", "never"):
        md.unpin(owner)
    assert idle(md) and set(hashes) <= set(md.cached_hashes())


def test_block_events_and_slots(engines) -> None:
    from shared.engine import EngineError

    p, _ = engines
    p.drain_block_events()
    prompt = prompt_of(7, 48)
    p.add_request("e", prompt, greedy(1))
    run_all(p)
    assert p.drain_block_events() == [("stored", h) for h in p.block_hashes(prompt)]
    assert p.drain_block_events() == []
    with pytest.raises(EngineError, match="RDMA"):
        p.slot_memory()


def test_logprobs_come_with_the_tokens(engines) -> None:
    from shared.engine import Mode
    from shared.engine.sampling_params import SamplingParams

    p, _ = engines
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompt = prompt_of(8, 40)
    p.add_request("lp", prompt, params, mode=Mode.PREFILL)
    (first,) = run_all(p)["lp"]
    assert first.logprobs.rank == 1 and first.logprobs.top_ids[0] == first.token_id  # greedy: the best
    assert len(first.logprobs.top_ids) == 3 and first.logprobs.logprob == first.logprobs.top_logprobs[0]
    assert len(first.prompt_logprobs) == len(prompt) - 1 and len(first.prompt_logprobs[0].top_ids) == 2
    assert p.abort("lp")
    p.add_request("lp2", prompt, params)
    outs = run_all(p)["lp2"]
    assert [o.logprobs.top_ids[0] for o in outs] == tokens_of(outs)


def test_a_block_gone_between_match_and_load_is_recomputed(engines, monkeypatch) -> None:
    """A fault this test fakes (a store that loses a block after vLLM matched it, which no
    real sequence of calls produces on one thread): vLLM recomputes it, the tokens stay exact."""
    from shared.engine import Mode

    p, md = engines
    prompt = prompt_of(9, 200)
    p.add_request("src", prompt, greedy(1), mode=Mode.PREFILL)
    (first,) = run_all(p)["src"]
    hashes = p.computed_block_hashes("src")
    kv = p.export_blocks(hashes)
    assert p.abort("src")
    ref = alone(p, prompt, 8)
    md.forget_cached()
    md.import_blocks(hashes, kv)
    real_get, lost = md.store.get, []

    def get(h: int):
        if not lost:
            lost.append(h)
            raise KeyError(h)
        return real_get(h)

    monkeypatch.setattr(md.store, "get", get)
    md.add_request("r", prompt + [first.token_id], greedy(8), num_prompt_tokens=len(prompt))
    outs = run_all(md)["r"]
    assert lost and [first.token_id, *tokens_of(outs)] == ref
    assert idle(md)
