"""A prefix crosses the WAN once, against a real system (`pdd up`): a request that shares
blocks still on their way to main decode for another request waits for that copy instead of
asking prefill to send them again, and still finishes exactly when that transfer ends
without them (its client left, or the relay finished it)."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from pdd.system import RunningSystem, start_system
from shared.config import EngineSettings, ModelSettings
from shared.engine import LLMEngine
from tests.e2e.test_e2e_pipelines import complete, prompt_of, ref_tokens, wait_idle
from tests.polling import wait_until
from tests.prometheus_samples import moved, scrape, wait_until_drained

PRESET = "small"
SLOW_MBPS = 24.0  # the shared prefix's KV (6 MB) takes ~2 s on the wire
# The relay is paced (the PDD_RELAY_MIN_STEP_S test knob, docs/testing.md): a request of
# RELAYED_TOKENS lasts at least RELAYED_TOKENS * RELAY_STEP_S = 2.4 s on the relay, on any host.
RELAY_STEP_S = 0.2
RELAYED_TOKENS = 12
CRAWL_MBPS = 4.0  # the shared prefix's KV takes ~12 s on the wire: the paced relay ends first
BASE_BLOCKS = 24  # 384 tokens: the shared prefix
SUFFIX_BLOCKS = 4  # 64 tokens of the second request's own
SHARED = "pdd_kv_blocks_shared_in_flight_total"
PER_BLOCK = 16 * 16384  # the small preset's KV bytes per 16-token block


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> RunningSystem:
    env = {
        "PDD_RELAY_MD_READY_TIMEOUT_S": "30",
        "PDD_RELAY_MIN_STEP_S": str(RELAY_STEP_S),
        "PDD_ROUTER_TOKEN_TIMEOUT_S": "30",
    }
    sysm = start_system(
        tmp_path_factory.mktemp("pdd-shared"), env, delay_ms=5, bandwidth_mbps=1000, model_preset=PRESET
    )
    yield sysm
    sysm.stop()


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    return LLMEngine(ModelSettings(preset=PRESET), EngineSettings(kv_memory_mb=64))


def md_samples(system: RunningSystem):
    return scrape(system.metrics_urls()["main_decode"])


def prefill_samples(system: RunningSystem):
    return scrape(system.metrics_urls()["prefill"])


def pair(salt: int) -> tuple[list[int], list[int]]:
    base = prompt_of(16 * BASE_BLOCKS, salt=salt)
    return base, base + prompt_of(16 * SUFFIX_BLOCKS, salt=salt + 1)


def md_open_entries(system: RunningSystem, name: str) -> float:
    return md_samples(system).get(
        ("pdd_open_entries", frozenset({"service": "main_decode", "map": name}.items())), 0
    )


def until_md_holds(system: RunningSystem, name: str, timeout_s: float = 10.0) -> None:
    """Until MD's map `name` (in_flight_blocks, in_flight_waiting) holds an entry."""
    wait_until(lambda: md_open_entries(system, name), timeout_s, 0.02, f"an entry in main decode's {name}")


def second_while_first_in_flight(
    system, first, longer: list[int], mbps: float = SLOW_MBPS
) -> tuple[httpx.Response, object]:
    """Send the second request once MD expects the first's blocks (it was prepared), over
    the slow bulk link; the second's response and first()'s result."""
    with system.shaped("bulk", bandwidth_mbps=mbps), concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(first)
        until_md_holds(system, "in_flight_blocks")
        b = pool.submit(complete, system, longer, max_tokens=8, ignore_eos=True, pdd={"pipeline": "p-md"})
        return b.result(), a.result()


def settled(system) -> None:
    assert wait_idle(system) == {}
    assert wait_until_drained(system, 20) == {}


def test_a_prefix_in_flight_crosses_the_wan_once(system, reference):
    base, longer = pair(salt=41)
    before, p_before = md_samples(system), prefill_samples(system)
    first = lambda: complete(system, base, max_tokens=8, ignore_eos=True, pdd={"pipeline": "p-md"})  # noqa: E731
    b, a = second_while_first_in_flight(system, first, longer)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    per_block = a.json()["pdd"]["wan_bytes"] / BASE_BLOCKS
    assert per_block > 0
    assert b.json()["pdd"]["wan_bytes"] == SUFFIX_BLOCKS * per_block  # only its own blocks crossed
    after, p_after = md_samples(system), prefill_samples(system)
    assert moved(before, after, SHARED, outcome="landed") > 0  # it waited for the first's copy
    # Each transfer's last blocks were timed from hand-over to MD's ack (pdd_kv_tail_seconds).
    assert moved(p_before, p_after, "pdd_kv_tail_seconds_count", path="wan") == 2
    assert 0 < moved(p_before, p_after, "pdd_kv_tail_seconds_sum", path="wan") < 60
    assert (
        0
        < moved(p_before, p_after, "pdd_kv_tail_bytes_total", path="wan")
        <= (BASE_BLOCKS + SUFFIX_BLOCKS) * PER_BLOCK
    )
    assert a.json()["choices"][0]["token_ids"] == ref_tokens(reference, base, max_tokens=8, ignore_eos=True)
    assert b.json()["choices"][0]["token_ids"] == ref_tokens(reference, longer, max_tokens=8, ignore_eos=True)
    settled(system)


def test_the_second_finishes_exactly_when_the_first_client_leaves_mid_transfer(system, reference):
    base, longer = pair(salt=43)
    before = md_samples(system)
    left = threading.Event()

    def first() -> None:  # streams, then hangs up after its first token, while its KV crosses
        payload = {
            "prompt": base,
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
            "pdd": {"pipeline": "p-md"},
        }
        with httpx.stream("POST", f"{system.router_url}/v1/completions", json=payload, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    until_md_holds(system, "in_flight_waiting")  # the second waits for its blocks
                    left.set()
                    return

    b, _ = second_while_first_in_flight(system, first, longer)
    assert left.is_set()
    assert b.status_code == 200, b.text
    assert b.json()["choices"][0]["token_ids"] == ref_tokens(reference, longer, max_tokens=8, ignore_eos=True)
    after = md_samples(system)
    assert moved(before, after, SHARED, outcome="computed") > 0  # MD computed what never came
    assert b.json()["pdd"]["wan_bytes"] < 2 * SUFFIX_BLOCKS * PER_BLOCK  # it asked for none again
    settled(system)


def test_the_second_finishes_exactly_when_the_relay_finished_the_first(system, reference):
    base, longer = pair(salt=45)
    before = md_samples(system)

    # Short and paced: the relay decodes it for at least 2.4 s, longer than the second takes to
    # be prepared at MD, and ends it long before MD's copy lands (~12 s at CRAWL_MBPS).
    def first() -> httpx.Response:
        return complete(
            system, base, max_tokens=RELAYED_TOKENS, ignore_eos=True, pdd={"pipeline": "p-rld-md"}
        )

    b, a = second_while_first_in_flight(system, first, longer, mbps=CRAWL_MBPS)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    seen = (a.json()["pdd"], b.json()["pdd"])
    assert a.json()["pdd"]["md_tokens"] == 0, seen
    assert b.json()["choices"][0]["token_ids"] == ref_tokens(reference, longer, max_tokens=8, ignore_eos=True)
    assert b.json()["pdd"]["wan_bytes"] < 2 * SUFFIX_BLOCKS * PER_BLOCK, seen  # it waited for the first's
    after = md_samples(system)
    outcomes = {o: moved(before, after, SHARED, outcome=o) for o in ("landed", "computed")}
    assert outcomes["computed"] > 0, (outcomes, seen)
    settled(system)
