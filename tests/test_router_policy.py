"""The router's pure routing policy: which pipeline, which MD, which relay."""

from services.router.policy import (
    InstanceLoad,
    choose_least_loaded,
    choose_main_decode,
    choose_pipeline,
    estimate_wan_seconds,
    resume_candidates,
)
from shared.bus.messages import Pipeline, Role

P_MD, P_RLD_MD = Pipeline.P_MD, Pipeline.P_RLD_MD


def test_low_hit_long_prompt_takes_the_relay():
    # 4000 tokens × 50 KB over 1 Gbit/s ≈ 1.6 s > 0.5 s threshold
    d = choose_pipeline(4000, 0, 50_000, 125e6, 0.03, 0.5, relay_available=True)
    assert d.pipeline == P_RLD_MD
    assert d.missing_bytes == 4000 * 50_000
    assert d.hit_rate == 0.0
    assert abs(d.est_wan_s - (0.015 + 4000 * 50_000 / 125e6)) < 1e-9


def test_high_hit_goes_straight_to_md():
    d = choose_pipeline(4000, 3968, 50_000, 125e6, 0.03, 0.5, relay_available=True)
    assert d.pipeline == P_MD
    assert d.missing_bytes == 32 * 50_000
    assert abs(d.hit_rate - 0.992) < 1e-9


def test_no_relay_means_p_md_never_relay_only():
    d = choose_pipeline(4000, 0, 50_000, 1e6, 0.03, 0.5, relay_available=False)
    assert d.pipeline == P_MD


def test_threshold_boundary_and_bandwidth_drop():
    fast = choose_pipeline(1000, 0, 1000, 10e6, 0.0, 0.1, True)  # exactly 0.1 s: not above the threshold
    assert fast.pipeline == P_MD
    slow = choose_pipeline(1000, 0, 1000, 5e6, 0.0, 0.1, True)  # bandwidth halves → 0.2 s
    assert slow.pipeline == P_RLD_MD


def test_cached_tokens_are_clamped():
    d = choose_pipeline(100, 500, 10, 1e6, 0.0, 1.0, True)
    assert d.missing_bytes == 0 and d.hit_rate == 1.0
    assert estimate_wan_seconds(0, 1e6, 0.04) == 0.02


def test_md_with_longest_prefix_wins_then_least_loaded():
    mds = [InstanceLoad("a", running=1), InstanceLoad("b", running=9), InstanceLoad("c", running=0)]
    assert choose_main_decode(mds, {"a": 3, "b": 7, "c": 0}) == "b"
    assert choose_main_decode(mds, {"a": 2, "b": 2, "c": 2}) == "c"
    assert choose_main_decode([], {}) is None


def test_least_loaded_relay():
    loads = [InstanceLoad("x", running=3), InstanceLoad("y", running=1, waiting=1), InstanceLoad("z", running=5)]
    assert choose_least_loaded(loads) == "y"
    assert choose_least_loaded([]) is None


def test_kv_queued_toward_md_pushes_a_request_onto_the_relay():
    # 200 × 1 KB alone: 0.2 s at 1 MB/s, under 0.5 s; behind 1 MB already queued: 1.2 s
    alone = choose_pipeline(200, 0, 1000, 1e6, 0.0, 0.5, True)
    queued = choose_pipeline(200, 0, 1000, 1e6, 0.0, 0.5, True, backlog_bytes=1_000_000)
    assert alone.pipeline == P_MD and queued.pipeline == P_RLD_MD
    # nothing to send: the backlog does not matter
    hit = choose_pipeline(200, 200, 1000, 1e6, 0.0, 0.5, True, backlog_bytes=10_000_000)
    assert hit.pipeline == P_MD


def test_a_lost_request_resumes_on_the_md_with_its_prefix_then_the_least_loaded_then_a_relay():
    mds = [InstanceLoad("m0", running=1), InstanceLoad("m1", running=5), InstanceLoad("m2", running=0)]
    relays = [InstanceLoad("r0", running=4), InstanceLoad("r1", running=2)]
    order = resume_candidates(mds, relays, {"m1": 3})
    assert order == [(Role.MAIN_DECODE, "m1"), (Role.MAIN_DECODE, "m2"), (Role.MAIN_DECODE, "m0"),
                     (Role.RELAY, "r1"), (Role.RELAY, "r0")]  # fmt: skip
    assert resume_candidates([], relays, {})[0] == (Role.RELAY, "r1")
    assert resume_candidates([], [], {}) == []
