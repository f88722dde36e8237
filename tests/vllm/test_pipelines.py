"""pdd's pipelines with vLLM engines in every role (`pdd up --engine vllm`, vLLM's CPU build):
P->MD, P->RLD->MD one-shot and catch-up, RLD alone when the WAN is cut, a shared prefix that
crosses the WAN once while in flight, and an MD killed mid-stream whose stream moves; greedy
tokens equal, token for token, to vLLM alone serving the same checkpoint, and nothing held
afterwards (no pinned block, no block of vLLM's paged cache in use, no open entry).

Runs only where vLLM imports (`make test-vllm`); minutes: a system of three vLLM engines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.llm_run import run_module
from tests.vllm.needs_vllm import needs_vllm

pytestmark = needs_vllm

PRESET = "small"
MD_READY_TIMEOUT_S = 5.0
RELAY_STEP_S = 0.04  # the paced relay (PDD_RELAY_MIN_STEP_S): the relay runs ahead of MD on any host
RELAYED_TOKENS = 120  # >= 4.8 s on the relay: MD takes over
SLOW_MBPS = 80.0  # 600 prompt tokens' KV (~9.8 MB) take ~1 s to cross
CUT_TOKENS = 250  # >= 10 s on the relay: MD's deadline fires while it decodes
PER_BLOCK = 16 * 16384  # the small preset's float32 KV bytes per 16-token block

CASES = {  # name -> (prompt, max_tokens): every reference, computed once by vLLM alone
    "p-md": ([(i * 7 + 16) % 250 for i in range(300)], 24),
    "one-shot": ([(i * 7 + 29) % 250 for i in range(600)], RELAYED_TOKENS),
    "catch-up": ([(i * 7 + 42) % 250 for i in range(600)], RELAYED_TOKENS),
    "rld-only": ([(i * 7 + 68) % 250 for i in range(300)], CUT_TOKENS),
    "shared-base": ([(i * 7 + 81) % 250 for i in range(384)], 8),
    "shared-longer": ([(i * 7 + 81) % 250 for i in range(384)] + [(i * 7 + 94) % 250 for i in range(64)], 8),
    "killed": ([(i * 11 + 4 * 17 + 5) % 250 for i in range(48)], 160),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The preset as a checkpoint directory, shared by the system's engines and vLLM alone."""
    import shared.vllm.checkpoint as ckpt
    from shared.config import ModelSettings
    from shared.model.describe import describe_model

    root = tmp_path_factory.mktemp("checkpoints")
    model = ModelSettings(preset=PRESET)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ckpt, "CHECKPOINTS", root)
        path = ckpt.vllm_checkpoint(model, describe_model(model))
    return path


@pytest.fixture(scope="module")
def alone(checkpoint, tmp_path_factory) -> dict[str, list[int]]:
    spec = {"model": str(checkpoint), "cases": list(CASES.values())}
    outs = run_module(tmp_path_factory.mktemp("alone"), "alone", "tests.vllm.alone", spec)
    return dict(zip(CASES, outs, strict=True))


@pytest.fixture(scope="module")
def system(checkpoint, tmp_path_factory):
    from pdd.system import start_system

    env = {
        "PDD_CHECKPOINT_DIR": str(checkpoint.parent),
        "PDD_RELAY_MD_READY_TIMEOUT_S": str(MD_READY_TIMEOUT_S),
        "PDD_RELAY_MIN_STEP_S": str(RELAY_STEP_S),
        "PDD_ROUTER_TOKEN_TIMEOUT_S": "60",
        "PDD_ENGINE__KV_CACHE_SPACE_GIB": "1",
    }
    sysm = start_system(
        tmp_path_factory.mktemp("pdd-vllm"), env, model_preset=PRESET, engine="vllm", timeout_s=300
    )
    yield sysm
    sysm.stop()


def complete(system, name: str, **body):
    import httpx

    prompt, max_tokens = CASES[name]
    payload = {"prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **body}
    r = httpx.post(f"{system.router_url}/v1/completions", json=payload, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def settled(system) -> None:
    from tests.e2e.test_e2e_faults import settled as nothing_held

    nothing_held(system, timeout_s=30)


def test_p_md_equals_vllm_alone(system, alone):
    body = complete(system, "p-md", pdd={"pipeline": "p-md"})
    assert body["pdd"]["pipeline"] == "p-md" and body["pdd"]["md_tokens"] == 23
    assert body["pdd"]["wan_bytes"] == 18 * PER_BLOCK  # the prompt's full blocks, once
    assert body["choices"][0]["token_ids"] == alone["p-md"]
    settled(system)


@pytest.mark.parametrize(
    ("name", "threshold", "mode"), [("one-shot", 10_000, "one-shot"), ("catch-up", 1, "catch-up")]
)
def test_relay_then_main_decode_equals_vllm_alone(system, alone, name, threshold, mode):
    with system.shaped("bulk", bandwidth_mbps=SLOW_MBPS):
        body = complete(system, name, pdd={"pipeline": "p-rld-md", "catchup_threshold": threshold})
    stats = body["pdd"]
    assert stats["pipeline"] == "p-rld-md" and stats["handoff_mode"] == mode
    assert stats["rld_tokens"] > 0 and stats["md_tokens"] > 0
    assert stats["handoff_batches"] >= (2 if mode == "catch-up" else 1)
    assert body["choices"][0]["token_ids"] == alone[name]
    settled(system)


def test_wan_cut_leaves_the_relay_alone_and_exact(system, alone):
    with system.shaped("bulk", cut=True):
        body = complete(system, "rld-only", pdd={"pipeline": "p-rld-md"})
    assert body["pdd"]["pipeline"] == "rld-only"
    assert body["choices"][0]["token_ids"] == alone["rld-only"]
    settled(system)


def test_a_prefix_in_flight_crosses_the_wan_once(system, alone):
    from tests.e2e.test_e2e_pipelines import complete as post
    from tests.e2e.test_e2e_shared_in_flight import SHARED, md_samples, moved, second_while_first_in_flight

    base, longer = CASES["shared-base"][0], CASES["shared-longer"][0]
    before = md_samples(system)
    first = lambda: post(system, base, max_tokens=8, ignore_eos=True, pdd={"pipeline": "p-md"})  # noqa: E731
    b, a = second_while_first_in_flight(system, first, longer)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert a.json()["pdd"]["wan_bytes"] == 24 * PER_BLOCK
    assert b.json()["pdd"]["wan_bytes"] == 4 * PER_BLOCK  # only its own blocks crossed
    assert moved(before, md_samples(system), SHARED, outcome="landed") > 0  # it waited for the first's copy
    assert a.json()["choices"][0]["token_ids"] == alone["shared-base"]
    assert b.json()["choices"][0]["token_ids"] == alone["shared-longer"]
    settled(system)


def test_main_decode_killed_mid_stream_moves_its_stream(system, alone):
    from tests.e2e.test_e2e_faults import body, kill, serves_again, stream

    payload = body("p-md", salt=4)
    assert payload["prompt"] == CASES["killed"][0] and payload["max_tokens"] == CASES["killed"][1]
    got = stream(system, payload, at_token=10, fault=kill(system, "main_decode"))
    assert got.error is None and got.done and got.tokens == alone["killed"]
    settled(system)
    serves_again(system, timeout_s=120)  # MD restarted by `pdd up` (a vLLM engine starts in ~10 s)
