"""A lossy WAN KV codec through the real system (`pdd up`): a request still completes on the
P→MD pipeline, the WAN carries about a quarter of fp32 KV's bytes, and a later request reuses
the decoded blocks MD cached. (That the exact default gives the single engine's tokens is what
the other e2e tests check.)"""

from __future__ import annotations

import httpx
import pytest
import torch

from pdd.system import RunningSystem, start_system
from shared.kv.codec import bytes_ratio

BLOCK = 16
KV_BYTES_PER_TOKEN = 512  # the tiny preset, fp32
SHAPE = (2, 2, 1, BLOCK, 2, 16)  # its blocks


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {"PDD_PREFILL_WAN_KV_CODEC": "int8"}
    sysm = start_system(tmp_path_factory.mktemp("pdd"), env, delay_ms=5, model_preset="tiny")
    yield sysm
    sysm.stop()


def complete(system: RunningSystem, prompt: list[int]) -> dict:
    body = {
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": 12,
        "ignore_eos": True,
        "pdd": {"pipeline": "p-md"},
    }
    r = httpx.post(f"{system.router_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_int8_wan_kv_completes_in_a_quarter_of_the_bytes(system) -> None:
    prompt = [(i * 7 + 3) % 250 for i in range(320)]  # 20 full blocks
    first = complete(system, prompt)
    assert first["pdd"]["pipeline"] == "p-md" and len(first["choices"][0]["token_ids"]) == 12
    exact = 320 * KV_BYTES_PER_TOKEN
    wire = exact / bytes_ratio("int8", SHAPE, torch.float32)
    assert wire <= first["pdd"]["wan_bytes"] < wire * 1.15  # the frames' headers on top
    second = complete(system, prompt + [(i * 11 + 5) % 250 for i in range(64)])  # 4 more blocks
    assert second["pdd"]["prefix_hit_rate"] == pytest.approx(320 / 384, abs=1e-3)
    assert second["pdd"]["wan_bytes"] < first["pdd"]["wan_bytes"] / 3
    assert len(second["choices"][0]["token_ids"]) == 12
