"""The router's registry of instances, fed by their load reports."""

from services.router.registry import Registry
from shared.bus.messages import LoadReport


def test_registry_reads_link_estimates_and_backlog_from_prefill_reports():
    reg = Registry()
    reg.update(LoadReport("prefill", "0", links={"tcp://md:1": {"bandwidth": 2e6, "rtt": 0.02, "backlog": 500}}))
    reg.update(LoadReport("prefill", "1", links={"tcp://md:1": {"backlog": 700}}))  # no measurement yet
    assert reg.link_to("tcp://md:1") == (2e6, 0.02)
    assert reg.wan_backlog("tcp://md:1") == 1200
    assert reg.link_to("tcp://other:1") is None and reg.wan_backlog("tcp://other:1") == 0
