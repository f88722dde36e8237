"""The whole system (`pdd up`) with prefill's KV to main decode on the RDMA path (the Mooncake
transfer engine in tcp mode): every pipeline gives the single-process engine's tokens, MD's
prefix cache still saves the blocks it holds, and a cut WAN still falls back to the relay.
One system for the module."""

from __future__ import annotations

import pytest

from pdd.system import RunningSystem, start_system
from shared.kv.rdma.engine import unavailable
from tests.e2e.test_e2e_pipelines import (
    MD_READY_TIMEOUT_S,
    PRESET,
    RELAY_STEP_S,
    assert_wan_cut_falls_back_to_relay,
    complete,
    prompt_of,
    ref_tokens,
    reference,  # noqa: F401 (a fixture)
    wait_idle,
)
from tests.prometheus_samples import moved, scrape

why = unavailable()
pytestmark = pytest.mark.skipif(why is not None, reason=f"rdma extra not usable: {why}")


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {
        "PDD_KV_TRANSPORT": "rdma",
        "PDD_RDMA__PROTOCOL": "tcp",
        "PDD_RDMA__HOST": "127.0.0.1",
        "PDD_RDMA__QUARANTINE_S": "1",
        "PDD_RELAY_MD_READY_TIMEOUT_S": str(MD_READY_TIMEOUT_S),
        "PDD_RELAY_MIN_STEP_S": str(RELAY_STEP_S),  # the relay outlasts MD's deadline on any host
        "PDD_ROUTER_TOKEN_TIMEOUT_S": "20",
    }
    sysm = start_system(
        tmp_path_factory.mktemp("pdd-rdma"), env, delay_ms=10, bandwidth_mbps=1000, model_preset=PRESET
    )
    yield sysm
    sysm.stop()


def rdma_bytes(system: RunningSystem) -> dict:
    return scrape(system.metrics_urls()["prefill"])


@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
def test_pipelines_over_rdma_match_single_engine(system, reference, pipeline):  # noqa: F811
    prompt = prompt_of(300, salt=20 + len(pipeline))
    before = rdma_bytes(system)
    r = complete(
        system,
        prompt,
        max_tokens=120,
        ignore_eos=True,
        pdd={"pipeline": pipeline, "catchup_threshold": 10_000},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pdd"]["pipeline"] == pipeline
    assert body["choices"][0]["token_ids"] == ref_tokens(reference, prompt, max_tokens=120, ignore_eos=True)
    wan = body["pdd"]["wan_bytes"]
    assert (
        wan > 0 and moved(before, rdma_bytes(system), "pdd_kv_rdma_bytes_total") == wan
    )  # all of it one-sided
    assert "RDMA path on: tcp engine" in system.log("main_decode") and "RDMA path on" in system.log("prefill")
    assert wait_idle(system) == {}


def test_prefix_held_by_md_is_not_written_again(system):
    base = prompt_of(320, salt=27)  # 20 full blocks
    first = complete(system, base, max_tokens=4, pdd={"pipeline": "p-md"})
    assert first.status_code == 200, first.text
    per_block = first.json()["pdd"]["wan_bytes"] / 20
    before = rdma_bytes(system)
    second = complete(system, base + prompt_of(64, salt=28), max_tokens=4, pdd={"pipeline": "p-md"})
    assert second.status_code == 200, second.text
    assert second.json()["pdd"]["wan_bytes"] == 4 * per_block  # only the 4 new full blocks crossed
    assert moved(before, rdma_bytes(system), "pdd_kv_rdma_bytes_total") == 4 * per_block


def test_wan_cut_falls_back_to_relay(system, reference):  # noqa: F811
    assert_wan_cut_falls_back_to_relay(system, reference, salt=29)
