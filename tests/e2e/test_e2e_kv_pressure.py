"""End to end under KV memory pressure: MD's pool holds a couple of requests at a time, more
arrive at once; they wait for memory instead of failing, and every one gives the single-process
engine's tokens. A request that can never fit MD's pool is a client error (400)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from tests.e2e.test_e2e_pipelines import prompt_of, ref_tokens

MD_POOL_BLOCKS = 32  # the tiny model: 16 tokens x 512 B per block, so 0.25 MB
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {
        "PDD_MD_ENGINE__KV_MEMORY_MB": str(MD_POOL_BLOCKS * 16 * 512 / 2**20),
        "PDD_ROUTER_TOKEN_TIMEOUT_S": "20",
    }
    sysm = start_system(tmp_path_factory.mktemp("pdd-kv"), env, delay_ms=1)
    yield sysm
    sysm.stop()


def complete(system: RunningSystem, prompt: list[int], **body) -> httpx.Response:
    payload = {"prompt": prompt, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{system.router_url}/v1/completions", json=payload, timeout=60)


def test_more_requests_than_md_holds_all_complete(system):
    # Each needs 12-14 of MD's 32 blocks for its life: two at a time, ten at once.
    prompts = [prompt_of(140 + 8 * i, salt=20 + i) for i in range(10)]
    pipelines = ["p-md", "p-rld-md"]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(
            pool.map(
                lambda ip: complete(
                    system, ip[1], max_tokens=MAX_TOKENS, pdd={"pipeline": pipelines[ip[0] % 2]}
                ),
                enumerate(prompts),
            )
        )
    reference = LLMEngine(ModelSettings(preset="tiny"), EngineSettings(kv_memory_mb=4))
    for prompt, r in zip(prompts, replies, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref_tokens(
            reference, prompt, max_tokens=MAX_TOKENS, ignore_eos=True
        )
    assert "waits for KV memory" in system.log("main_decode")  # the pool really was short


def test_request_larger_than_md_pool_is_a_client_error(system):
    r = complete(system, prompt_of(300, salt=40), max_tokens=300)  # 599 tokens of KV > 512
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "main decode's whole KV pool holds 32 blocks (512 tokens)" in message, message
