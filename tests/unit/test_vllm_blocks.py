"""pdd's 16-token blocks against vLLM's larger blocks of the same prompt."""

from __future__ import annotations

import random

import pytest

from shared.config import EngineSettings
from shared.engine.hashing import block_hashes
from shared.kv.vllm_blocks import (
    PDD_BLOCK_SIZE,
    block_ratio,
    complete_vllm_blocks,
    held_run,
    leading_complete,
    pdd_blocks_of,
    tokens_covered,
    vllm_block_hash,
    vllm_block_hashes,
)

MODEL = "m"


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def test_pdd_block_size_is_the_engine_default():
    assert PDD_BLOCK_SIZE == EngineSettings.model_fields["block_size"].default == 16


@pytest.mark.parametrize("size", [8, 24, 100, 0, -16])
def test_a_size_that_is_not_a_multiple_is_refused_naming_both(size):
    with pytest.raises(ValueError, match=rf"vLLM block size {size} .*pdd's block size 16"):
        block_ratio(size)
    with pytest.raises(ValueError, match=str(size)):
        tokens_covered(256, 16, size)


def test_ratio_and_pdd_blocks_of_a_vllm_block():
    assert block_ratio(16) == 1 and block_ratio(128) == 8 and block_ratio(48) == 3
    assert pdd_blocks_of(0, 128) == range(0, 8)
    assert pdd_blocks_of(2, 128) == range(16, 24)
    assert pdd_blocks_of(5, 16) == range(5, 6)  # equal sizes: one pdd block each
    assert pdd_blocks_of(1, 64, pdd_block_size=32) == range(2, 4)
    with pytest.raises(ValueError, match="negative"):
        pdd_blocks_of(-1, 128)


def test_the_last_pdd_hash_names_a_vllm_block_and_its_prefix():
    tokens = _prompt(128 * 3 + 50)  # 3 full vLLM blocks of 128 and a partial one
    hashes = block_hashes(tokens, 16, MODEL)
    assert len(hashes) == 27
    assert vllm_block_hashes(hashes, 128) == [hashes[7], hashes[15], hashes[23]]
    assert [vllm_block_hash(hashes, j, 128) for j in range(4)] == [hashes[7], hashes[15], hashes[23], None]
    # the same as hashing the prefix up to the block's end
    assert vllm_block_hash(hashes, 1, 128) == block_hashes(tokens[:256], 16, MODEL)[-1]
    # a prompt that differs only in vLLM block 1 shares block 0's name, not the later ones
    other = tokens[:200] + [(tokens[200] + 1) % 32000] + tokens[201:]
    other_names = vllm_block_hashes(block_hashes(other, 16, MODEL), 128)
    assert other_names[0] == hashes[7]
    assert all(a != b for a, b in zip(other_names[1:], vllm_block_hashes(hashes, 128)[1:], strict=True))


def test_equal_block_sizes_map_one_to_one():
    hashes = block_hashes(_prompt(16 * 5 + 3), 16, MODEL)
    assert vllm_block_hashes(hashes, 16) == hashes
    assert complete_vllm_blocks(hashes, set(hashes[:2]) | {hashes[4]}, 16) == [0, 1, 4]
    assert tokens_covered(83, 3, 16) == 48


def test_a_prompt_shorter_than_one_vllm_block_has_none():
    hashes = block_hashes(_prompt(127), 16, MODEL)
    assert len(hashes) == 7
    assert vllm_block_hashes(hashes, 128) == []
    assert vllm_block_hash(hashes, 0, 128) is None
    assert tokens_covered(127, 7, 128) == 0
    assert complete_vllm_blocks(hashes, set(hashes), 128) == []
    assert vllm_block_hashes([], 128) == [] and tokens_covered(0, 0, 128) == 0


@pytest.mark.parametrize(
    ("num_tokens", "held", "size", "covered"),
    [
        (300, 18, 128, 256),  # 2 full vLLM blocks; the partial third covers nothing
        (300, 15, 128, 128),  # block 1 lacks its last pdd block
        (300, 100, 128, 256),  # more held than the prompt has: the prompt bounds it
        (256, 16, 128, 256),  # exactly two blocks
        (256, 0, 128, 0),
        (100, 6, 32, 96),  # 6 pdd blocks = 3 blocks of 32
        (100, 5, 32, 64),
        (17, 1, 16, 16),  # a partial trailing pdd block is never covered
    ],
)
def test_tokens_covered_by_full_vllm_blocks(num_tokens, held, size, covered):
    assert tokens_covered(num_tokens, held, size) == covered


def test_leave_last_keeps_the_prompt_last_token_to_compute():
    assert tokens_covered(256, 16, 128) == 256
    assert tokens_covered(256, 16, 128, leave_last=True) == 128  # 255 tokens: one full block
    assert tokens_covered(257, 16, 128, leave_last=True) == 256
    assert tokens_covered(16, 1, 16, leave_last=True) == 0
    assert tokens_covered(0, 0, 16, leave_last=True) == 0
    with pytest.raises(ValueError, match="negative"):
        tokens_covered(-1, 0, 16)


def test_held_run_stops_at_the_first_missing_block():
    hashes = block_hashes(_prompt(16 * 6), 16, MODEL)
    assert held_run(hashes, set(hashes)) == 6
    assert held_run(hashes, {hashes[0], hashes[1], hashes[3]}) == 2
    assert held_run(hashes, {hashes[1]}) == 0
    assert held_run([], set()) == 0


def test_complete_vllm_blocks_from_pdd_blocks_landed_in_any_order():
    hashes = block_hashes(_prompt(128 * 3 + 40), 16, MODEL)  # 3 full vLLM blocks, 26 pdd blocks
    landed: set[int] = set()
    order = list(range(len(hashes)))
    random.Random(3).shuffle(order)
    seen = []
    for i in order:
        landed.add(hashes[i])
        seen.append(complete_vllm_blocks(hashes, landed, 128))
    assert seen[-1] == [0, 1, 2]  # the partial fourth block (pdd blocks 24, 25) never completes
    # complete only once all 8 of its pdd blocks are in
    assert complete_vllm_blocks(hashes, set(hashes[8:16]), 128) == [1]
    assert complete_vllm_blocks(hashes, set(hashes[8:15]) | set(hashes[16:24]), 128) == [2]
    assert complete_vllm_blocks(hashes, set(), 128) == []
    assert leading_complete([1]) == 0 and leading_complete([0, 1, 3]) == 2 and leading_complete([]) == 0


def test_landed_blocks_of_another_prompt_complete_nothing():
    hashes = block_hashes(_prompt(256, seed=1), 16, MODEL)
    other = block_hashes(_prompt(256, seed=2), 16, MODEL)
    assert complete_vllm_blocks(hashes, set(other), 128) == []
    assert held_run(hashes, set(other)) == 0
