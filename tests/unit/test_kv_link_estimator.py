import pytest

from services.router.routing import policy
from shared.kv.link_estimator import LinkEstimator, estimate_wan_seconds


def test_defaults_before_any_observation() -> None:
    est = LinkEstimator(default_bandwidth=100e6, default_rtt=0.02)
    assert est.bandwidth("md") == 100e6 and est.rtt("md") == 0.02
    assert est.estimate_seconds("md", 0) == 0.01
    assert est.estimate_seconds("md", 100_000_000) == pytest.approx(0.01 + 1.0)
    assert est.snapshot() == {}


def test_wan_estimate_is_half_an_rtt_plus_serialisation() -> None:
    assert estimate_wan_seconds(50_000_000, 100e6, 0.04) == pytest.approx(0.02 + 0.5)
    assert estimate_wan_seconds(0, 100e6, 0.04) == 0.02  # nothing to send still waits out the latency
    assert estimate_wan_seconds(-1, 100e6, 0.04) == 0.02
    assert estimate_wan_seconds(1000, 0.0, 0.0) == 1000.0  # no bandwidth figure: 1 B/s, not a crash


def test_estimator_and_router_share_the_one_formula() -> None:
    est = LinkEstimator(default_bandwidth=100e6, default_rtt=0.02)
    est.observe_rtt("md", 0.05)
    for nbytes in (0, 1, 10 << 20):
        assert est.estimate_seconds("md", nbytes) == estimate_wan_seconds(nbytes, 100e6, 0.05)
    assert policy.estimate_wan_seconds is estimate_wan_seconds


def test_first_sample_replaces_prior_then_ewma() -> None:
    est = LinkEstimator(alpha=0.5, default_rtt=0.0)
    est.observe_rtt("md", 0.010)
    est.observe_rtt("md", 0.030)
    assert est.rtt("md") == pytest.approx(0.020)
    est.observe_transfer("md", 10_000_000, 0.020 + 0.1)  # one RTT is taken out: 100 MB/s
    assert est.bandwidth("md") == pytest.approx(100e6)
    est.observe_transfer("md", 10_000_000, 0.020 + 0.05)  # 200 MB/s
    assert est.bandwidth("md") == pytest.approx(150e6)
    snap = est.snapshot()["md"]
    assert snap["transfers"] == 2 and snap["rtt_samples"] == 2 and snap["bandwidth"] == pytest.approx(150e6)


def test_small_or_degenerate_samples_are_ignored() -> None:
    est = LinkEstimator(default_bandwidth=1e6)
    est.observe_transfer("md", 1000, 0.5)  # latency-dominated
    est.observe_transfer("md", 10 << 20, 0.0)
    est.observe_rtt("md", -1)
    assert est.bandwidth("md") == 1e6 and est.snapshot() == {}


def test_sub_rtt_transfer_is_bounded() -> None:
    est = LinkEstimator(default_rtt=0.1)
    est.observe_transfer("md", 1 << 20, 0.05)  # faster than one RTT: trust at most 10x of the wall time
    assert est.bandwidth("md") == pytest.approx((1 << 20) / 0.005)


def test_peers_are_independent() -> None:
    est = LinkEstimator()
    est.observe_rtt("a", 0.001)
    assert est.rtt("b") == est.default_rtt
    assert set(est.snapshot()) == {"a"}


def test_bad_alpha() -> None:
    with pytest.raises(ValueError):
        LinkEstimator(alpha=0)
