"""The parts of the vLLM connector that need no vLLM: the block store, the planning and vLLM's CPU
cache layout against pdd's block groups (the connector itself: tests/vllm)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.hashing import block_hashes
from shared.kv.device_blocks import DeviceBlocks
from shared.vllm.block_store import BlockStore
from shared.vllm.cache_layout import keys_from_pdd, keys_to_pdd, nhd_view
from shared.vllm.plan import blocks_to_save, load_span, matched_tokens, prompt_block_names

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


def test_a_vllm_block_is_named_by_its_last_pdd_block() -> None:
    prompt = list(range(1, 300))
    pdd = block_hashes(prompt, 16, "m")
    assert prompt_block_names(prompt, BLOCK, "m") == [pdd[7], pdd[15]]
    assert prompt_block_names(prompt, BLOCK, "other") != [pdd[7], pdd[15]]
    with pytest.raises(ValueError):
        prompt_block_names(prompt, 40, "m")


def test_matched_tokens_never_cover_the_last_token(tmp_path) -> None:
    store = BlockStore(tmp_path)
    for name in (11, 22, 33):
        store.put(name, torch.zeros(1))
    assert matched_tokens([11, 22, 33], store.held_run, 3 * BLOCK + 1, BLOCK) == 3 * BLOCK
    assert matched_tokens([11, 22, 33], store.held_run, 3 * BLOCK, BLOCK) == 2 * BLOCK
    assert matched_tokens([11, 44, 33], store.held_run, 3 * BLOCK + 1, BLOCK) == BLOCK  # a gap ends it
    assert matched_tokens([44, 22], store.held_run, 3 * BLOCK, BLOCK) == 0
    # the engine's own first block, then the store's: a store need not hold what the engine has
    assert matched_tokens([44, 22, 33], store.held_run, 3 * BLOCK + 1, BLOCK, local_tokens=BLOCK) == 3 * BLOCK
    assert matched_tokens([44, 55, 33], store.held_run, 3 * BLOCK + 1, BLOCK, local_tokens=BLOCK) == BLOCK


def test_load_span_is_the_matched_blocks_past_vllms_own_hit() -> None:
    assert load_span(3 * BLOCK, 2 * BLOCK, BLOCK) == range(1, 3)
    assert load_span(2 * BLOCK, 2 * BLOCK, BLOCK) == range(0, 2)
    with pytest.raises(ValueError):
        load_span(2 * BLOCK, 100, BLOCK)


def test_blocks_to_save_follow_the_computed_prompt() -> None:
    # a 300-token prompt (2 full blocks) prefilled in chunks of 200, then decoded
    assert blocks_to_save(2, 300, 200, 0, BLOCK) == range(0, 1)
    assert blocks_to_save(2, 300, 300, 1, BLOCK) == range(1, 2)
    assert not blocks_to_save(2, 300, 301, 2, BLOCK)


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
