"""The router's registry of instances, fed by their load reports."""

from services.router.routing.registry import Registry
from shared.bus.messages import LinkReport, LoadReport, Role


def test_registry_reads_link_estimates_and_backlog_from_prefill_reports():
    reg = Registry()
    reg.update(
        LoadReport(Role.PREFILL, "0", links=[LinkReport("tcp://md:1", backlog=500, bandwidth=2e6, rtt=0.02)])
    )
    reg.update(
        LoadReport(Role.PREFILL, "1", links=[LinkReport("tcp://md:1", backlog=700)])
    )  # no measurement yet
    reg.update(
        LoadReport(Role.MAIN_DECODE, "md", links=[LinkReport("tcp://md:1", backlog=10**9)])
    )  # not prefill's
    assert reg.link_to("tcp://md:1") == (2e6, 0.02)
    assert reg.wan_backlog("tcp://md:1") == 1200
    assert reg.link_to("tcp://other:1") is None and reg.wan_backlog("tcp://other:1") == 0


def test_two_measured_links_average():
    reg = Registry()
    reg.update(LoadReport(Role.PREFILL, "0", links=[LinkReport("a", bandwidth=1e6, rtt=0.01)]))
    reg.update(LoadReport(Role.PREFILL, "1", links=[LinkReport("a", bandwidth=3e6, rtt=0.03)]))
    assert reg.link_to("a") == (2e6, 0.02)
    assert [r.instance for r in reg.alive(Role.PREFILL)] == ["0", "1"] and reg.alive(Role.RELAY) == []


def test_a_draining_instance_is_alive_but_never_chosen():
    reg = Registry()
    reg.update(LoadReport(Role.MAIN_DECODE, "0"))
    reg.update(LoadReport(Role.MAIN_DECODE, "1", draining=True))
    assert [r.instance for r in reg.alive(Role.MAIN_DECODE)] == ["0", "1"]  # its requests are not lost
    assert [m.instance for m in reg.loads(Role.MAIN_DECODE)] == ["0"]
