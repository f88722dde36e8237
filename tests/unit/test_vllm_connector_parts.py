"""The parts of the vLLM connector that need no vLLM: the block store, the planning and vLLM's CPU
cache layout against pdd's block groups (the connector itself: tests/vllm)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.hashing import block_hashes
from shared.kv.device_blocks import DeviceBlocks
from shared.vllm.block_store import BlockStore
from shared.vllm.cache_layout import keys_from_pdd, keys_to_pdd, nhd_view
from shared.vllm.plan import (
    load_hashes,
    load_span,
    matched_tokens,
    pdd_blocks_to_save,
    prompt_hashes,
    save_places,
)

BLOCK = 128


def test_store_round_trip_and_leading_run(tmp_path) -> None:
    store = BlockStore(tmp_path / "s")
    group = torch.randn(2, 2, 1, BLOCK, 2, 8).to(torch.bfloat16)
    store.put(7, group[:, :, :1])
    assert store.has(7) and not store.has(8)
    assert torch.equal(store.get(7), group)
    store.put(9, torch.zeros(1))
    assert store.held_run([7, 8, 9]) == 1 and store.held_run([7, 9]) == 2
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [store.path(7).name, store.path(9).name]
    with pytest.raises(KeyError):
        store.get(8)


def test_store_keeps_the_first_copy_of_a_block(tmp_path) -> None:
    store = BlockStore(tmp_path)
    store.put(1, torch.ones(3))
    store.put(1, torch.zeros(3))
    assert torch.equal(store.get(1), torch.ones(3))


def test_prompt_hashes_are_pdds_chained_hashes() -> None:
    prompt = list(range(1, 300))
    assert prompt_hashes(prompt, "m") == block_hashes(prompt, 16, "m")
    assert prompt_hashes(prompt, "other") != prompt_hashes(prompt, "m")


def test_matched_tokens_are_whole_vllm_blocks_of_held_pdd_blocks(tmp_path) -> None:
    store = BlockStore(tmp_path)
    hashes = list(range(100, 124))  # 24 pdd blocks: 3 vLLM blocks of 8
    for h in hashes[:20]:
        store.put(h, torch.zeros(1))
    # 20 pdd blocks held: 2 whole vLLM blocks
    assert matched_tokens(hashes, store.held_run, 3 * BLOCK + 1, BLOCK) == 2 * BLOCK
    store.put(hashes[20], torch.zeros(1))
    for h in hashes[21:]:
        store.put(h, torch.zeros(1))
    assert matched_tokens(hashes, store.held_run, 3 * BLOCK + 1, BLOCK) == 3 * BLOCK
    # never the last token: an exactly 3-block prompt leaves its last block to vLLM
    assert matched_tokens(hashes, store.held_run, 3 * BLOCK, BLOCK) == 2 * BLOCK
    gap = [*hashes[:3], 999, *hashes[4:]]
    assert matched_tokens(gap, store.held_run, 3 * BLOCK + 1, BLOCK) == 0  # a gap ends the run
    # the engine's own first vLLM block, then the store's: the store need not hold what vLLM has
    own = [*range(900, 908), *hashes[8:]]
    assert matched_tokens(own, store.held_run, 3 * BLOCK + 1, BLOCK, local_tokens=BLOCK) == 3 * BLOCK
    with pytest.raises(ValueError):
        matched_tokens(hashes, store.held_run, 3 * BLOCK, 40)


def test_load_span_is_the_matched_blocks_past_vllms_own_hit() -> None:
    assert load_span(3 * BLOCK, 2 * BLOCK, BLOCK) == range(1, 3)
    assert load_span(2 * BLOCK, 2 * BLOCK, BLOCK) == range(0, 2)
    with pytest.raises(ValueError):
        load_span(2 * BLOCK, 100, BLOCK)
    hashes = list(range(24))
    assert load_hashes(hashes, range(1, 3), BLOCK) == hashes[8:24]


def test_pdd_blocks_to_save_follow_the_computed_prompt() -> None:
    # a 300-token prompt (18 full pdd blocks) prefilled in chunks of 200, then decoded
    assert pdd_blocks_to_save(18, 300, 200, 0) == range(0, 12)
    assert pdd_blocks_to_save(18, 300, 300, 12) == range(12, 18)
    assert not pdd_blocks_to_save(18, 300, 301, 18)
    # the partial last vLLM block's full pdd blocks are saved, at their places in it
    assert save_places(range(12, 18), BLOCK) == [(1, 4), (1, 5), (1, 6), (1, 7), (2, 0), (2, 1)]


def _vllm_vec_cache(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[num_blocks, heads, block_size, 2 * head_dim] as vLLM's `vec` CPU kernels fill it from
    k, v [num_blocks, block_size, heads, head_dim]: per block and head, the keys as
    [head_dim, block_size], then the values as [block_size, head_dim]."""
    nb, bs, heads, dim = k.shape
    per_head = torch.cat(
        (k.permute(0, 2, 3, 1).reshape(nb, heads, -1), v.permute(0, 2, 1, 3).reshape(nb, heads, -1)), -1
    )
    return per_head.view(nb, heads, bs, 2 * dim)


def test_vllm_cpu_blocks_gather_as_pdd_groups_and_scatter_back() -> None:
    gen = torch.Generator().manual_seed(0)
    nb, bs, heads, dim = 6, 32, 2, 8
    ks = [torch.randn(nb, bs, heads, dim, generator=gen) for _ in range(3)]
    vs = [torch.randn(nb, bs, heads, dim, generator=gen) for _ in range(3)]
    caches = [_vllm_vec_cache(k, v) for k, v in zip(ks, vs, strict=True)]
    copies = DeviceBlocks("NHD")
    ids = [4, 1]
    copy = copies.gather([nhd_view(c) for c in caches], ids)
    keys_to_pdd(copy.host)
    for layer in range(3):
        for i, b in enumerate(ids):
            assert torch.equal(copy.host[layer, 0, i], ks[layer][b])
            assert torch.equal(copy.host[layer, 1, i], vs[layer][b])
    group = copy.host.clone()
    copy.release()

    fresh = [torch.zeros_like(c) for c in caches]
    copies.scatter(keys_from_pdd(group), [nhd_view(c) for c in fresh], [0, 5])
    for layer in range(3):
        assert torch.equal(fresh[layer][0], caches[layer][4]) and torch.equal(
            fresh[layer][5], caches[layer][1]
        )
        assert not fresh[layer][1:5].any()
