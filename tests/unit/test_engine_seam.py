"""The engine seam's contract (shared/engine/seam.py), through its methods alone: what prefill,
relay and main decode rely on. Each test runs against every engine in ENGINES."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from shared.config import EngineSettings, ModelSettings
from shared.engine import Engine, EngineError, FinishReason, Mode
from shared.engine.factory import build_engine
from shared.engine.kv_admission import Verdict
from tests.engine_util import greedy, random_prompt, run_all, tokens_of

MakeEngine = Callable[[float], Engine]  # KV memory in MB -> a fresh engine of the tiny model
ENGINES: dict[str, MakeEngine] = {
    "pdd": lambda mb: build_engine(ModelSettings(preset="tiny"), EngineSettings(kv_memory_mb=mb)),
}
BLOCK_BYTES = 16 * 512  # the tiny preset's float32 KV per block of 16 tokens


@pytest.fixture(params=list(ENGINES))
def make(request: pytest.FixtureRequest) -> MakeEngine:
    return ENGINES[request.param]


def one_engine_tokens(make: MakeEngine, prompt: list[int], n: int) -> list[int]:
    engine = make(1.0)
    engine.add_request("ref", prompt, greedy(n))
    return tokens_of(run_all(engine)["ref"])


def prefill(engine: Engine, rid: str, prompt: list[int], n: int) -> tuple[int, list[int], torch.Tensor]:
    """Prefill's use: first token, then the prompt's computed full blocks exported."""
    engine.add_request(rid, prompt, greedy(n), mode=Mode.PREFILL)
    (out,) = run_all(engine)[rid]
    assert out.finish_reason is FinishReason.PREFILLED and out.index == 0 and out.ends is None
    hashes = engine.computed_block_hashes(rid)
    return out.token_id, hashes, engine.export_blocks(hashes)


def test_identity_and_limits(make: MakeEngine) -> None:
    engine = make(1.0)
    assert isinstance(engine, Engine)
    assert engine.model_id and engine.block_size == 16 and engine.max_model_len >= 2
    fmt = engine.block_format()
    assert fmt.shape[1] == 2 and fmt.shape[2] == engine.block_size
    stats = engine.stats()
    assert stats.num_blocks == 2**20 // BLOCK_BYTES and stats.free_blocks == stats.num_blocks
    assert (engine.num_requests(), engine.num_pin_owners(), engine.has_unfinished()) == (0, 0, False)
    assert engine.lifetime_blocks(40, greedy(24)) == 4  # (40 + 24) / 16
    prompt = random_prompt(random.Random(1), 40)
    assert len(engine.block_hashes(prompt)) == 2 and engine.block_hashes(prompt) == make(1.0).block_hashes(
        prompt
    )


def test_prefill_export_import_decode_equals_one_engine(make: MakeEngine) -> None:
    prompt = random_prompt(random.Random(2), 40)
    p, d = make(1.0), make(1.0)
    first, hashes, kv = prefill(p, "r", prompt, 20)
    assert hashes == p.block_hashes(prompt) and len(hashes) == 2
    fmt = p.block_format()
    assert kv.dtype == fmt.dtype and tuple(kv.shape) == (*fmt.shape[:2], 2, *fmt.shape[2:])
    assert kv.device.type == "cpu"

    assert d.import_blocks(hashes, kv, pin="r") == 2
    assert d.import_blocks(hashes, kv) == 0  # cached already: idempotent by hash
    d.add_request("r", prompt + [first], greedy(20), num_prompt_tokens=len(prompt))
    d.unpin("r")  # the request references its blocks now
    outs = run_all(d)["r"]
    assert [o.index for o in outs] == list(range(1, 20)) and outs[-1].finish_reason is FinishReason.LENGTH
    assert [first, *tokens_of(outs)] == one_engine_tokens(make, prompt, 20)
    assert d.stats().prefix_hit_tokens == 32  # the imported blocks were used, not recomputed
    assert p.abort("r") and p.num_requests() == 0  # prefill keeps the blocks until released


def test_extend_by_token_ids_continues_as_one_engine(make: MakeEngine) -> None:
    prompt = random_prompt(random.Random(3), 37)
    ref = one_engine_tokens(make, prompt, 16)
    md = make(1.0)
    md.add_request("r", prompt + ref[:3], greedy(16), num_prompt_tokens=len(prompt), mode=Mode.HOLD)
    assert [(o.computed, o.token_id) for o in run_all(md)["r"]] == [(True, None)]  # computed, then held
    md.extend("r", ref[3:6], final=False)
    assert [(o.computed, o.token_id) for o in run_all(md)["r"]] == [(True, None)]
    assert md.generated_token_ids("r") == ref[:6]
    md.extend("r", ref[6:8], final=True)
    outs = run_all(md)["r"]
    assert outs[0].index == 8 and tokens_of(outs) == ref[8:]
    assert md.num_requests() == 0  # finished: forgotten


def test_abort_frees_blocks_back_to_the_start_count(make: MakeEngine) -> None:
    engine = make(1.0)
    free = engine.stats().free_blocks
    prompt = random_prompt(random.Random(4), 50)
    engine.add_request("a", prompt, greedy(30))
    engine.add_request("p", prompt[:20], greedy(5), mode=Mode.PREFILL)
    for _ in range(5):
        engine.step()
    assert engine.stats().free_blocks < free and engine.num_requests() == 2
    assert engine.abort("a") and engine.abort("p")
    assert not engine.abort("a") and not engine.abort("never")
    assert engine.stats().free_blocks == free and engine.num_requests() == 0
    assert not engine.has_unfinished()
    with pytest.raises(EngineError):
        engine.generated_token_ids("a")


def test_pins_and_reservations_hold_blocks_until_unpin(make: MakeEngine) -> None:
    prompt = random_prompt(random.Random(5), 64)
    _, hashes, kv = prefill(make(1.0), "src", prompt, 4)
    md = make(1.0)
    free = md.stats().free_blocks
    verdict, have = md.reserve("a", hashes, md.lifetime_blocks(len(prompt), greedy(4)))
    assert (verdict, have) == (Verdict.ADMIT, 0)
    assert md.stats().free_blocks == free - 4  # room set aside for the blocks it lacks
    assert md.import_blocks(hashes[:2], kv[:, :, :2], pin="a") == 2  # "a" brings two itself
    assert md.reserve("b", hashes, 5) == (Verdict.ADMIT, 2)  # pins the two cached, room for two
    assert md.import_blocks(hashes[2:], kv[:, :, 2:], pin="b") == 2
    assert md.share("a", hashes[2:]) == hashes[2:]  # landed with "b"'s transfer: pinned for "a" too
    assert md.num_pin_owners() == 2 and md.stats().pinned_blocks == 8
    md.unpin("a")
    md.unpin("b")
    md.unpin("never")
    assert md.num_pin_owners() == 0 and md.stats().free_blocks == free
    assert set(hashes) <= set(md.cached_hashes())  # unpinned blocks stay cached


def test_slots_filled_in_place_are_cached_on_adopt(make: MakeEngine) -> None:
    prompt = random_prompt(random.Random(6), 48)
    _, hashes, kv = prefill(make(1.0), "src", prompt, 4)
    md = make(1.0)
    free = md.stats().free_blocks
    assert md.reserve("r", hashes, 4)[0] is Verdict.ADMIT
    slots = md.take_spare("r", 3)
    assert len(set(slots)) == 3 and md.take_spare("r", 1) == []
    memory = md.slot_memory()
    for i, slot in enumerate(slots[:2]):  # the one-sided write, as the RDMA path makes it
        memory[:, :, slot].copy_(kv[:, :, i])
        md.adopt("r", hashes[i], slot)
    md.return_spare("r", slots[2])
    (again,) = md.take_spare("r", 1)
    md.release_blocks([again])
    assert set(md.cached_hashes()) == set(hashes[:2])  # adopted; the returned slot is not cached
    assert torch.equal(md.export_blocks(hashes[:2]), kv[:, :, :2])
    md.unpin("r")
    assert md.stats().free_blocks == free


def test_block_events_tell_what_the_cache_gained_and_lost(make: MakeEngine) -> None:
    engine = make(6 * BLOCK_BYTES / 2**20)  # six blocks
    rng = random.Random(7)
    first, second = random_prompt(rng, 48), random_prompt(rng, 80)
    assert engine.drain_block_events() == []
    engine.add_request("a", first, greedy(1))
    run_all(engine)
    gained = engine.block_hashes(first)
    assert engine.drain_block_events() == [("stored", h) for h in gained]
    assert engine.drain_block_events() == []  # drained
    assert set(engine.cached_hashes()) == set(gained)
    engine.add_request("b", second, greedy(1))  # five blocks: evicts from the first prompt's
    run_all(engine)
    events = engine.drain_block_events()
    evicted = [h for kind, h in events if kind == "evicted"]
    assert evicted and set(evicted) <= set(gained)
    assert [h for kind, h in events if kind == "stored"] == engine.block_hashes(second)
    assert set(engine.cached_hashes()) == (set(gained) - set(evicted)) | set(engine.block_hashes(second))
