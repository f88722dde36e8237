"""KV admission: the lifetime-block policy, the pool size from available memory, MD's
reservations in the engine (imports never run out), and MD's bounded FIFO wait."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from services.main_decode.prepare_admission import KVAdmissionQueue, KVBusy
from shared.config import EngineSettings
from shared.engine import EngineError, Mode
from shared.engine.kv_admission import Verdict, admission_verdict, request_blocks
from shared.engine.kv_memory import host_available_bytes, kv_pool_bytes
from tests.engine_util import greedy, make_engine, random_prompt, run_all, tokens_of
from tests.polling import until

BLOCK_MB = 16 * 512 / 2**20  # one block of the tiny model: 16 tokens x 512 bytes


# ---- policy ---------------------------------------------------------------------------------
def test_request_blocks_covers_every_token_but_the_last_sampled():
    assert request_blocks(16, 1, 4096, 16) == 1  # 16 tokens of KV, the 17th is never computed
    assert request_blocks(16, 2, 4096, 16) == 2
    assert request_blocks(100, 1000, 512, 16) == 32  # capped by max_model_len


@pytest.mark.parametrize(
    ("need", "committed", "pool", "take_now", "free_now", "verdict"),
    [
        (10, 0, 10, 10, 10, Verdict.ADMIT),  # exactly the pool
        (11, 0, 10, 0, 10, Verdict.NEVER),  # more than the whole pool, even when idle
        (5, 6, 10, 1, 10, Verdict.WAIT),  # promised to others
        (5, 5, 10, 5, 4, Verdict.WAIT),  # the blocks to import are not free yet
        (5, 5, 10, 5, 5, Verdict.ADMIT),
    ],
)
def test_admission_verdict(need, committed, pool, take_now, free_now, verdict):
    assert admission_verdict(need, committed, pool, take_now, free_now) is verdict


def test_pool_size_explicit_or_fraction_of_available(tmp_path):
    def never() -> int:
        raise AssertionError("available memory read although the size is explicit")

    assert kv_pool_bytes(8, 0.05, never) == 8 * 2**20
    assert kv_pool_bytes(None, 0.25, lambda: 4000) == 1000
    with pytest.raises(EngineError, match="kv_memory_fraction"):
        kv_pool_bytes(None, 0, lambda: 4000)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\n")
    assert host_available_bytes(str(meminfo)) == 12000000 * 1024


def test_engine_pool_from_fraction(monkeypatch):
    # (what the host has available moves while other processes run: a fixed figure here)
    monkeypatch.setattr("shared.engine.engine.available_bytes", lambda device: 1000 * 16 * 512)
    engine = make_engine(kv_memory_mb=None, kv_memory_fraction=0.01)
    assert engine.pool.num_blocks == 10


def test_engine_pool_sized_as_vllm_sizes_its_cpu_pool():
    """No size given: kv_cache_space_gib (vLLM's VLLM_CPU_KVCACHE_SPACE), 4 GiB by default."""
    assert kv_pool_bytes(None, None, lambda: 1 / 0, lambda: 123) == 123
    engine = make_engine(kv_memory_mb=None, kv_cache_space_gib=1 / 1024)  # 1 MiB
    assert engine.pool.num_blocks == 2**20 // (16 * 512)
    assert EngineSettings().kv_cache_space_gib == 4.0 and EngineSettings().gpu_memory_utilization == 0.9


# ---- reservations in the engine ---------------------------------------------------------------
def _exported(prompt: list[int]):
    src = make_engine()
    src.add_request("p", prompt, greedy(1), mode=Mode.PREFILL)
    run_all(src)
    hashes = src.computed_block_hashes("p")
    return hashes, src.exchange.export_blocks(hashes)


def test_reserved_import_survives_a_full_pool():
    """Blocks set aside at prepare are the import's, whatever else fills the pool meanwhile."""
    prompt = random_prompt(random.Random(1), 64)  # 4 full blocks
    hashes, kv = _exported(prompt)
    md = make_engine(kv_memory_mb=12 * BLOCK_MB)
    verdict, have = md.exchange.reserve("r", hashes, md.lifetime_blocks(len(prompt), greedy(16)))
    assert (verdict, have) == (Verdict.ADMIT, 0) and md.exchange.promised_blocks == 5
    md.add_request("other", random_prompt(random.Random(2), 120), greedy(2), mode=Mode.HOLD)
    run_all(md)
    assert md.pool.num_free == 0  # "other" holds every block not set aside
    assert md.exchange.import_blocks(hashes, kv, pin="r") == 4
    md.release("other")
    md.add_request("r", prompt + [1], greedy(16), num_prompt_tokens=len(prompt))
    assert len(tokens_of(run_all(md)["r"])) == 15
    md.exchange.unpin("r")
    assert md.exchange.promised_blocks == 0 and md.pool.num_free == md.pool.num_blocks


def test_reserve_waits_for_promised_blocks_and_refuses_the_impossible():
    prompt = random_prompt(random.Random(3), 64)
    hashes, _ = _exported(prompt)
    md = make_engine(kv_memory_mb=8 * BLOCK_MB)
    assert md.exchange.reserve("a", hashes, 6)[0] is Verdict.ADMIT
    before = md.pool.num_free
    assert md.exchange.reserve("b", hashes, 3)[0] is Verdict.WAIT  # 6 + 3 > 8
    assert md.pool.num_free == before and "b" not in md.exchange.pins  # a refusal changes nothing
    assert md.exchange.reserve("c", hashes, 9)[0] is Verdict.NEVER
    md.exchange.unpin("a")
    assert md.exchange.reserve("b", hashes, 3)[0] is Verdict.ADMIT
    with pytest.raises(EngineError, match="already holds"):
        md.exchange.reserve("b", hashes, 3)


# ---- MD's bounded FIFO wait --------------------------------------------------------------------
class Pool:
    """Stands in for the engine's ledger: `free` slots, `need` taken per admitted request."""

    def __init__(self, free: int):
        self.free, self.order, self.undone = free, [], []
        self.freed_event = asyncio.Event()

    def give(self, n: int) -> None:
        self.free += n
        self.freed_event.set()

    async def freed(self) -> None:
        """Like the engine service's: woken by a free, or after a short bound."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.freed_event.wait(), 0.05)
        self.freed_event.clear()

    def attempt(self, rid: str, need: int = 1):
        async def attempt():
            if self.free < need:
                return None
            self.free -= need
            self.order.append(rid)
            return rid

        return attempt

    def undo(self, rid: str):
        async def undo():
            self.undone.append(rid)

        return undo


async def _admit(queue: KVAdmissionQueue, pool: Pool, rid: str, need: int = 1):
    return await queue.admit(rid, pool.attempt(rid, need), pool.undo(rid))


async def test_waiters_are_admitted_in_arrival_order():
    pool = Pool(free=1)
    queue = KVAdmissionQueue(max_waiting=8, max_wait_s=30, freed=pool.freed)
    assert await _admit(queue, pool, "a") == "a"
    waiters = [asyncio.create_task(_admit(queue, pool, rid)) for rid in "bcd"]
    await until(lambda: list(queue.waiting) == ["b", "c", "d"], 5)
    for admitted in range(2, 5):
        pool.give(1)
        await until(lambda n=admitted: len(pool.order) == n, 5)
    assert await asyncio.gather(*waiters) == ["b", "c", "d"] and pool.order == ["a", "b", "c", "d"]


async def test_small_request_does_not_pass_a_large_one_waiting():
    pool = Pool(free=0)
    queue = KVAdmissionQueue(max_waiting=8, max_wait_s=30, freed=pool.freed)
    large = asyncio.create_task(_admit(queue, pool, "large", need=2))
    await until(lambda: list(queue.waiting) == ["large"], 5)
    small = asyncio.create_task(_admit(queue, pool, "small", need=1))
    pool.give(1)
    await asyncio.sleep(0.02)  # an absence: watched a while, the small one does not pass
    assert pool.order == [] and list(queue.waiting) == ["large", "small"]
    pool.give(2)
    assert await asyncio.wait_for(asyncio.gather(large, small), 5) == ["large", "small"]


async def test_full_queue_and_long_wait_answer_busy():
    pool = Pool(free=0)
    queue = KVAdmissionQueue(max_waiting=1, max_wait_s=0.05, freed=pool.freed)
    waiter = asyncio.create_task(_admit(queue, pool, "a"))
    await until(lambda: list(queue.waiting) == ["a"], 5)
    with pytest.raises(KVBusy, match="already wait"):
        await _admit(queue, pool, "b")
    with pytest.raises(KVBusy, match="within"):
        await waiter
    assert not queue.waiting


async def test_cancelled_waiter_leaves_the_queue():
    pool = Pool(free=0)
    queue = KVAdmissionQueue(max_waiting=4, max_wait_s=30, freed=pool.freed)
    waiter = asyncio.create_task(_admit(queue, pool, "a"))
    await until(lambda: list(queue.waiting) == ["a"], 5)
    queue.cancel("a")
    assert await asyncio.wait_for(waiter, 5) is None
    assert not queue.waiting and pool.order == []
