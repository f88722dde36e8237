"""`pdd top`'s gathering (pure: parse, rates between two scrapes, the view) and one rendered
frame, from hand-made metrics text; tests/e2e/test_e2e_telemetry.py runs it against a system."""

from __future__ import annotations

import pytest
from rich.console import Console

from pdd.top import Scrape, build_view, by_label, human_bytes, instance_rows, parse_metrics, rates, render

BEFORE = """\
# TYPE pdd_requests counter
pdd_requests_total{outcome="ok",pipeline="p-md"} 10.0
pdd_requests_total{outcome="error",pipeline="p-md"} 2.0
pdd_requests_total{outcome="ok",pipeline="p-rld-md"} 4.0
# TYPE pdd_router_output_tokens counter
pdd_router_output_tokens_total{role="relay"} 10.0
pdd_router_output_tokens_total{role="main_decode"} 90.0
# TYPE pdd_router_wan_bytes counter
pdd_router_wan_bytes_total{md="0"} 1000.0
# TYPE pdd_router_handoffs counter
pdd_router_handoffs_total{mode="one-shot"} 3.0
# TYPE pdd_wan_bandwidth_bytes_per_second gauge
pdd_wan_bandwidth_bytes_per_second{peer="0"} 1.25e+07
pdd_wan_bandwidth_bytes_per_second{peer="1"} 2.5e+06
"""
AFTER = """\
# TYPE pdd_requests counter
pdd_requests_total{outcome="ok",pipeline="p-md"} 15.0
pdd_requests_total{outcome="error",pipeline="p-md"} 3.0
pdd_requests_total{outcome="ok",pipeline="p-rld-md"} 6.0
pdd_requests_total{outcome="ok",pipeline="rld-only"} 1.0
# TYPE pdd_router_output_tokens counter
pdd_router_output_tokens_total{role="relay"} 40.0
pdd_router_output_tokens_total{role="main_decode"} 160.0
# TYPE pdd_router_wan_bytes counter
pdd_router_wan_bytes_total{md="0"} 5000.0
pdd_router_wan_bytes_total{md="1"} 200.0
# TYPE pdd_router_handoffs counter
pdd_router_handoffs_total{mode="one-shot"} 5.0
pdd_router_handoffs_total{mode="catch-up"} 1.0
# TYPE pdd_wan_bandwidth_bytes_per_second gauge
pdd_wan_bandwidth_bytes_per_second{peer="0"} 1.25e+07
pdd_wan_bandwidth_bytes_per_second{peer="1"} 2.5e+06
"""
INSTANCES = {
    "main_decode/3f2a9c1b7d4e": dict(
        running=1, waiting=0, used_blocks=30, free_blocks=70, num_blocks=100, held=1, draining=True
    ),
    "prefill/0": dict(
        running=2, waiting=1, used_blocks=5, free_blocks=95, num_blocks=100, held=2, draining=False
    ),
    "main_decode/0": dict(
        running=3, waiting=0, used_blocks=50, free_blocks=50, num_blocks=100, held=3, draining=False
    ),
    "relay/0": dict(
        running=1, waiting=0, used_blocks=20, free_blocks=80, num_blocks=100, held=1, draining=False
    ),
}


def _scrapes() -> tuple[Scrape, Scrape]:
    return Scrape(100.0, parse_metrics(BEFORE), INSTANCES), Scrape(102.0, parse_metrics(AFTER), INSTANCES)


def test_parse_and_sum_by_label() -> None:
    samples = parse_metrics(AFTER)
    assert samples[("pdd_requests_total", frozenset({"outcome": "ok", "pipeline": "p-md"}.items()))] == 15.0
    assert by_label(samples, "pdd_requests_total", "pipeline") == {
        "p-md": 18.0,
        "p-rld-md": 6.0,
        "rld-only": 1.0,
    }
    assert by_label(samples, "pdd_requests_total", "nope") == {}


def test_rates_between_two_scrapes() -> None:
    before, after = _scrapes()  # 2 s apart
    assert rates(before, after, "pdd_requests_total", "pipeline") == {
        "p-md": 3.0,
        "p-rld-md": 1.0,
        "rld-only": 0.5,
    }
    assert rates(after, after, "pdd_requests_total", "pipeline") == {}  # no time passed: no rate
    # a counter that went down restarted (the router was restarted): what it has now is the increase
    restarted = Scrape(104.0, parse_metrics('pdd_requests_total{pipeline="p-md",outcome="ok"} 4.0\n'), {})
    assert rates(after, restarted, "pdd_requests_total", "pipeline") == {"p-md": 2.0}


def test_view_of_two_scrapes() -> None:
    before, after = _scrapes()
    view = build_view(before, after)
    assert view.window_s == 2.0
    assert view.requests_per_s == {"p-md": 3.0, "p-rld-md": 1.0, "rld-only": 0.5}
    assert view.wan == {"0": (2000.0, 1.25e7), "1": (100.0, 2.5e6)}
    assert view.rld_share == pytest.approx(30 / 100)  # in the window: 30 of 100 tokens
    assert view.rld_share_total == pytest.approx(40 / 200)
    assert view.handoffs == {"catch-up": (0.5, 1.0), "one-shot": (1.0, 5.0)}
    first = build_view(None, after)  # one scrape: instances and totals, no rates yet
    assert first.requests_per_s == {} and first.rld_share is None and first.window_s == 0
    console = Console(record=True, width=100)
    console.print(render(build_view(None, Scrape(0.0, {}, {})), "http://router:8000"))
    text = console.export_text()
    assert "rates: after the next scrape" in text and "no KV link used yet" in text


def test_instances_by_datacenter_then_role() -> None:
    rows = instance_rows(INSTANCES)
    assert [(r.dc, r.role, r.instance) for r in rows] == [
        ("dc-a", "prefill", "0"),
        ("dc-a", "relay", "0"),
        ("dc-b", "main_decode", "0"),
        ("dc-b", "main_decode", "3f2a9c1b7d4e"),
    ]
    assert rows[-1].draining and rows[-1].used_blocks == 30


def test_one_frame_shows_every_instance_and_the_rates() -> None:
    console = Console(record=True, width=80)
    console.print(render(build_view(*_scrapes()), "http://router:8000"))
    text = console.export_text()
    for key in INSTANCES:
        assert key in text
    assert "requests/s  p-md 3.00  p-rld-md 1.00  rld-only 0.50  total 4.50" in text
    assert "50/100" in text and "draining" in text
    assert "2.0 KiB/s" in text and "11.9 MiB/s" in text  # MD 0: received, bandwidth estimate
    assert "RLD share of output tokens  30.0% now, 20.0% in all" in text
    assert "one-shot 1.00/s (5 in all)" in text


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (12, 2048, 3 * 2**20, 5 * 2**40)] == [
        "12 B",
        "2.0 KiB",
        "3.0 MiB",
        "5120.0 GiB",
    ]
