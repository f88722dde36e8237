import random

import pytest

from shared.wan import LinkSettings, Shaper
from shared.wan.cli import build_parser, parse_link


def test_rate_is_enforced_by_virtual_clock() -> None:
    s = Shaper(LinkSettings(bandwidth_mbps=8.0), burst_s=0.0)  # 1 MB/s
    t = [s.serialize(100_000, now=0.0) for _ in range(10)]
    assert t[0] == pytest.approx(0.1) and t[-1] == pytest.approx(1.0)
    assert s.serialize(1000, now=5.0) == pytest.approx(5.001)  # idle link: no backlog


def test_burst_credit_is_bounded() -> None:
    s = Shaper(LinkSettings(bandwidth_mbps=8.0), burst_s=0.01)
    assert s.serialize(5_000, now=10.0) == 10.0  # within 10 ms of credit: goes at once
    assert s.serialize(100_000, now=10.0) == pytest.approx(10.0 - 0.01 + 0.105)


def test_unlimited_and_delay() -> None:
    s = Shaper(LinkSettings(delay_ms=20))
    assert s.serialize(10**9, now=1.0) == 1.0
    assert s.propagate(1.0, last_release=0.0) == pytest.approx(1.02)


def test_jitter_never_reorders() -> None:
    s = Shaper(LinkSettings(delay_ms=5, jitter_ms=5), rng=random.Random(1))
    last, releases = 0.0, []
    for i in range(1000):
        last = s.propagate(i * 0.0001, last)
        releases.append(last)
    assert releases == sorted(releases)
    assert all(r - i * 0.0001 <= 0.0101 for i, r in enumerate(releases))


BAD_SETTINGS = [
    {"delay_ms": -1},
    {"delay_ms": float("inf")},
    {"delay_ms": float("nan")},
    {"delay_ms": 1e308},
    {"jitter_ms": -0.5},
    {"jitter_ms": 60_001},
    {"bandwidth_mbps": -1},
    {"bandwidth_mbps": float("inf")},
    {"bandwidth_mbps": float("nan")},
    {"bandwidth_mbps": 2e6},
]


@pytest.mark.parametrize("bad", BAD_SETTINGS, ids=lambda b: "{}={}".format(*next(iter(b.items()))))
def test_settings_out_of_range_are_refused_by_name(bad: dict) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        LinkSettings(**bad).validate()


def test_settings_validation_and_queue_limit() -> None:
    LinkSettings(delay_ms=60_000, jitter_ms=60_000, bandwidth_mbps=1e6).validate()  # the bounds themselves
    LinkSettings(bandwidth_mbps=None).validate()  # unlimited
    s = Shaper(LinkSettings(delay_ms=50, bandwidth_mbps=1000))
    assert s.queue_limit() >= 2 * 125e6 * 0.05  # at least 2x the bandwidth-delay product
    assert 4 << 10 <= Shaper(LinkSettings(bandwidth_mbps=1)).chunk_size() <= 256 << 10


def test_parse_link() -> None:
    link = parse_link("bulk=127.0.0.1:7401>127.0.0.1:7400,delay_ms=3,bandwidth_mbps=none", {"delay_ms": 1.0})
    assert (link.name, link.listen, link.target) == ("bulk", "127.0.0.1:7401", "127.0.0.1:7400")
    assert link.settings.delay_ms == 3 and link.settings.bandwidth_mbps is None
    assert parse_link("x=h:1->h:2", {}).listen == "h:1"
    for bad in ("nope", "x=h:1", "x=h:1>h:2,foo=1"):
        with pytest.raises(ValueError):
            parse_link(bad, {})


@pytest.mark.parametrize("value", ["inf", "nan", "1e308", "-1", "60001", "fast"])
def test_bad_delay_in_flags_and_link_options_is_refused(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--delay-ms", value])
    assert "delay_ms" in capsys.readouterr().err  # argparse prints the reason, not just "invalid value"
    with pytest.raises(ValueError, match="delay_ms"):
        parse_link(f"x=h:1>h:2,delay_ms={value}", {})


def test_bandwidth_flag_unlimited_and_bounds() -> None:
    assert build_parser().parse_args(["--bandwidth-mbps", "none"]).bandwidth_mbps is None
    assert build_parser().parse_args(["--bandwidth-mbps", "0"]).bandwidth_mbps is None
    assert build_parser().parse_args(["--bandwidth-mbps", "250"]).bandwidth_mbps == 250.0
    for bad in ("nan", "-5", "2e6"):
        with pytest.raises(ValueError, match="bandwidth_mbps"):
            parse_link(f"x=h:1>h:2,bandwidth_mbps={bad}", {})
