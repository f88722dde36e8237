"""Control messages lost on the bus are repaired within about a second, not by the router's
10 s stall rule, and the tokens stay exact (`pdd up`, real processes).

The loss is injected: with PDD_FAULT_DROP_FIRST_COPY the sender drops the first copy of each
message of the named kinds before it leaves, as NATS drops one in flight when a server
restarts. One lost NATS message cannot be produced on cue otherwise."""

from __future__ import annotations

import httpx
import pytest

from bench.client import stream_completion
from pdd.system import RunningSystem, start_system
from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from tests.e2e.test_e2e_pipelines import prompt_of, ref_tokens, wait_idle
from tests.prometheus_samples import moved, scrape

PRESET = "small"
DROPPED = ("MainDecodeTarget", "HandoffBatch", "KVReady", "RelayStart")
RESENT = "pdd_bus_control_resent_total"
# The relay is paced (the PDD_RELAY_MIN_STEP_S test knob): a relayed request of RELAYED_TOKENS
# cannot end on the relay in under RELAYED_TOKENS * RELAY_STEP_S = 20 s, on any host, while
# the handoff the test repairs takes about two seconds (three lost messages, each sent again
# after its ack timeout). Once MD takes over it decodes the rest unpaced.
RELAY_STEP_S = 0.1
RELAYED_TOKENS = 200


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {
        "PDD_FAULT_DROP_FIRST_COPY": ",".join(DROPPED),
        "PDD_RELAY_MD_READY_TIMEOUT_S": "30",
        "PDD_RELAY_MIN_STEP_S": str(RELAY_STEP_S),
    }
    sysm = start_system(
        tmp_path_factory.mktemp("pdd-lossy"), env, delay_ms=5, bandwidth_mbps=1000, model_preset=PRESET
    )
    yield sysm
    sysm.stop()


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(ModelSettings(preset=PRESET), EngineSettings(kv_memory_mb=64))


def samples(system: RunningSystem) -> dict:
    return {name: scrape(url) for name, url in system.metrics_urls().items()}


def test_a_lost_md_target_and_handoff_batch_cost_about_a_second(system, reference):
    prompt = prompt_of(80, salt=51)
    before = samples(system)
    with httpx.Client(base_url=system.router_url) as client:
        got = stream_completion(client, prompt, 24, pipeline="p-md", timeout=60)
    assert got.ok, got.error
    assert got.token_ids == ref_tokens(reference, prompt, max_tokens=24, ignore_eos=True)
    assert got.max_gap < 2.5  # two lost messages, each sent again after its ack timeout
    after = samples(system)
    assert moved(before["router"], after["router"], RESENT, kind="MainDecodeTarget") >= 1
    assert moved(before["prefill"], after["prefill"], RESENT, kind="HandoffBatch") >= 1
    assert wait_idle(system) == {}


def test_lost_relay_start_kv_ready_and_handoff_batch_are_repaired(system, reference):
    # Each lost message delays the handoff by about half a second while the relay decodes on,
    # paced, so MD still takes over (one-shot: a single final batch).
    prompt = prompt_of(400, salt=53)
    before = samples(system)
    with httpx.Client(base_url=system.router_url) as client:
        got = stream_completion(
            client, prompt, RELAYED_TOKENS, pipeline="p-rld-md", catchup_threshold=100_000, timeout=90
        )
    assert got.ok, got.error
    assert got.token_ids == ref_tokens(reference, prompt, max_tokens=RELAYED_TOKENS, ignore_eos=True)
    assert got.pdd["rld_tokens"] > 0 and got.pdd["md_tokens"] > 0  # handed over
    assert got.max_gap < 2.5
    after = samples(system)
    assert moved(before["prefill"], after["prefill"], RESENT, kind="RelayStart") >= 1
    assert moved(before["main_decode"], after["main_decode"], RESENT, kind="KVReady") >= 1
    assert moved(before["relay"], after["relay"], RESENT, kind="HandoffBatch") >= 1
    assert wait_idle(system) == {}
