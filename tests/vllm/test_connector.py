"""PddConnector in real vLLM engines (the CPU build): a producer saves a prompt's full blocks
under pdd's hashes, a consumer in a fresh process (prefix caching off) loads them and gives
exactly the greedy tokens of vLLM alone; with vLLM's prefix cache on, the connector loads only
the blocks past its hit. Minutes: each engine starts in its own process.

Runs only where vLLM imports (never under `make test`):
    PYTHONPATH=$PWD ~/.cache/pdd/vllm-venv/bin/python -m pytest --noconftest tests/vllm -p no:cacheprovider
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.vllm.llm_run import export_small, generate
from tests.vllm.needs_vllm import needs_vllm

pytestmark = needs_vllm

MODEL_ID = "small-s0"
BLOCK = 128  # vLLM's block size on the CPU backend


def _layer0_kv(model_dir: Path, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's keys (rotated) and values for tokens from position 0, from the checkpoint alone:
    [T, kv_heads, head_dim] each."""
    from safetensors.torch import load_file

    sd = load_file(str(model_dir / "model.safetensors"))
    cfg = json.loads((model_dir / "config.json").read_text())
    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
    h = h * sd["model.layers.0.input_layernorm.weight"]
    heads, dim = cfg["num_key_value_heads"], cfg["head_dim"]
    k = (h @ sd["model.layers.0.self_attn.k_proj.weight"].T).view(len(tokens), heads, dim)
    v = (h @ sd["model.layers.0.self_attn.v_proj.weight"].T).view(len(tokens), heads, dim)
    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(len(tokens)).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    k1, k2 = k.chunk(2, -1)
    return k * cos + torch.cat((-k2, k1), -1) * sin, v


def test_consumer_loads_the_producers_blocks_and_gives_vllms_tokens(tmp_path: Path) -> None:
    from shared.vllm.block_store import BlockStore
    from shared.vllm.plan import prompt_hashes

    model = export_small(tmp_path / "model")
    store_dir = tmp_path / "store"
    a = [(i * 7 + 3) % 250 + 1 for i in range(300)]  # 2 full vLLM blocks and 44 tokens
    d = [(i * 11 + 5) % 250 + 1 for i in range(300)]  # as long, other tokens
    e = [(i * 13 + 1) % 250 + 1 for i in range(200)]  # nothing of it is ever stored
    f = a[:256]  # exactly 2 blocks: the last token's block is computed, so only 1 is loaded
    common = {"model": str(model), "max_tokens": 16, "store": str(store_dir), "model_id": MODEL_ID}

    alone = generate(tmp_path, "alone", {**common, "prompts": [a, d, f]})
    g_a, g_d, g_f = alone["outputs"]
    assert alone["cached"] == [0, 0, 0]

    # prefilled in chunks of 160 tokens: pdd blocks 0-9 are saved after the first step, 10-17
    # (the partial last vLLM block's two full pdd blocks included) after the second
    producer = {**common, "kv_role": "kv_producer", "prompts": [a], "chunk": 160}
    produced = generate(tmp_path, "producer", producer)
    assert produced["outputs"] == [g_a]  # saving changes nothing
    store = BlockStore(store_dir)
    hashes_a, hashes_d = prompt_hashes(a, MODEL_ID), prompt_hashes(d, MODEL_ID)
    assert len(hashes_a) == 18
    assert sorted(p.name for p in store_dir.iterdir()) == sorted(store.path(h).name for h in hashes_a)

    # The stored groups are pdd's layout: layer 0 of pdd blocks 0..7 is the keys and values of
    # tokens 0..127.
    group = torch.cat([store.get(h) for h in hashes_a[:8]], dim=3)
    assert tuple(group.shape) == (8, 2, 1, BLOCK, 4, 64)
    k, v = _layer0_kv(model, a[:BLOCK])
    torch.testing.assert_close(group[0, 1, 0], v, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(group[0, 0, 0], k, rtol=1e-4, atol=1e-4)

    # d's names hold a's KV: a consumer that attends to what it loaded must go wrong on d.
    for h_a, h_d in zip(hashes_a, hashes_d, strict=True):
        store.put(h_d, store.get(h_a))

    consumed = generate(tmp_path, "consumer", {**common, "kv_role": "kv_consumer", "prompts": [a, d, e, f]})
    assert consumed["cached"] == [2 * BLOCK, 2 * BLOCK, 0, BLOCK]
    assert consumed["outputs"][0] == g_a
    assert consumed["outputs"][3] == g_f
    assert consumed["outputs"][1] != g_d

    # vLLM's own prefix cache holds block 0 (computed for a shorter prompt before), a store only
    # block 1: the connector loads block 1 into its place.
    only_block_1 = BlockStore(tmp_path / "store_block_1")
    for h in hashes_a[8:16]:
        only_block_1.put(h, store.get(h))
    hit = {
        **common,
        "store": str(only_block_1.root),
        "kv_role": "kv_consumer",
        "prefix_caching": True,
        "prompts": [a[:200]],
        "then": [a],
    }
    both = generate(tmp_path, "consumer_with_prefix_cache", hit)
    assert both["cached"] == [0, 2 * BLOCK]
    assert both["outputs"][1] == g_a
