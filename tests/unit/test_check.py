"""`pdd check`'s verdicts: pure functions of what the probes observed."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from pdd.check import (
    FAIL,
    OK,
    SKIP,
    WARN,
    Verdict,
    bulk_verdict,
    clock_verdict,
    exit_code,
    gatewayz_verdict,
    heard_verdict,
    local_only,
    names_host,
    own_cert_verdict,
    parse_identity,
    peer_cert_verdict,
    service_of,
)
from shared.bus.permissions import allows
from shared.env_file import parse_env_file

NOW = dt.datetime(2026, 12, 2, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)
ROUTER = ["spiffe://pdd/dc-a/router"]


def test_identity_from_the_uri_san():
    assert parse_identity(["https://x", "spiffe://pdd/dc-b/main_decode/md-7"]) == (
        "dc-b",
        "main_decode",
        "md-7",
    )
    assert parse_identity(ROUTER) == ("dc-a", "router", None)
    assert parse_identity(["spiffe://other/dc-a/router", "spiffe://pdd/dc-a"]) is None


def test_own_cert():
    def verdict(before=NOW - DAY, after=NOW + 300 * DAY, uris=ROUTER, role="router", dc="dc-a") -> Verdict:
        return own_cert_verdict(before, after, uris, role, dc, NOW)

    assert verdict().status == OK
    assert verdict(after=NOW + 10 * DAY).status == WARN  # within 30 days
    assert verdict(after=NOW - DAY).status == FAIL and "expired" in verdict(after=NOW - DAY).reason
    assert verdict(before=NOW + DAY).status == FAIL  # not yet valid: a clock off
    assert verdict(uris=[]).status == FAIL  # no identity: peers refuse it
    assert verdict(role="prefill").status == FAIL  # another role's certificate
    assert verdict(role="prefill").reason.startswith("wrong role (router, expected prefill)")
    assert verdict(dc="dc-b").status == FAIL  # another DC's
    assert verdict(dc="dc-b").reason.startswith("wrong datacenter (dc-a, expected dc-b)")


def test_server_names_the_host_it_is_dialed_at():
    nats = ["spiffe://pdd/dc-a/nats/nats-a"]
    assert names_host("10.200.0.1", [], ["10.200.0.1"]) and names_host("Nats-A.", ["nats-a"], [])
    assert not names_host("10.200.0.2", ["10.200.0.2"], [])  # an IP must be an IP SAN
    assert peer_cert_verdict("c", "nats-a", ["nats-a"], [], nats, "nats").status == OK
    wrong_host = peer_cert_verdict("c", "10.200.0.1", ["nats-a"], ["127.0.0.1"], nats, "nats")
    assert wrong_host.status == FAIL and "not 10.200.0.1" in wrong_host.reason
    assert peer_cert_verdict("c", "nats-a", ["nats-a"], [], ROUTER, "nats").status == FAIL  # not a server's
    assert peer_cert_verdict("c", "nats-a", ["nats-a"], [], [], "nats").status == FAIL


def test_a_peer_of_another_role_is_that_fault_whatever_hosts_it_names():
    relay = ["spiffe://pdd/dc-a/relay"]
    # DC A's relay certificate at MD's address names DC A's hosts, not MD's: the role is the fault
    v = peer_cert_verdict("md bulk", "10.200.0.2", ["relay"], ["10.200.0.1"], relay, "main_decode")
    assert v.status == FAIL and v.reason.startswith("wrong role (relay, expected main_decode)")
    assert "add-host" not in v.reason


def test_gateway_verdicts():
    assert (
        gatewayz_verdict({"outbound_gateways": {"nats-b": {}}, "inbound_gateways": {"nats-b": []}}).status
        == OK
    )
    assert gatewayz_verdict({"outbound_gateways": {"nats-b": {}}, "inbound_gateways": {}}).status == FAIL
    assert heard_verdict("dc-b", ["pdd.load.main_decode.*"], ["main_decode/0"], 1.5).status == OK
    assert heard_verdict("dc-b", ["pdd.load.main_decode.*"], [], 1.5).status == FAIL
    assert heard_verdict("dc-b", [], [], 1.5).status == WARN  # these credentials cannot tell


def test_an_advertised_loopback_or_wildcard_is_a_warning_at_best():
    for address in (
        "tcp://127.0.0.1:7400",
        "tcp://127.0.1.1:7400",
        "tcp://0.0.0.0:7400",
        "tcp://localhost:1",
    ):
        assert local_only(address), address
    assert local_only("tcp://10.200.0.2:7400") is None
    answered = Verdict(OK, "md bulk", "names 127.0.0.1")
    assert bulk_verdict(answered, None) is answered
    assert bulk_verdict(answered, local_only("tcp://127.0.0.1:1")).status == WARN
    assert bulk_verdict(Verdict(FAIL, "md bulk", "refused"), "loopback").status == FAIL


def test_clock_uses_the_tightest_sample_and_warns_past_100_ms():
    assert clock_verdict("dc-b", []).status == WARN
    assert clock_verdict("dc-b", [("md/0", 0.004, 0.030)]).status == OK
    assert clock_verdict("dc-b", [("md/0", 0.250, 0.030)]).status == WARN
    # 120 ms off, but a 300 ms round trip cannot tell it from 0: no warning on that sample alone
    assert clock_verdict("dc-b", [("md/0", 0.120, 0.300)]).status == OK
    tight = clock_verdict("dc-b", [("md/0", 0.0, 0.5), ("md/1", 0.2, 0.01)])
    assert tight.status == WARN and "md/1" in tight.reason


def test_exit_code_is_one_on_any_fail_only():
    assert exit_code([Verdict(OK, "a", ""), Verdict(WARN, "b", ""), Verdict(SKIP, "c", "")]) == 0
    assert exit_code([Verdict(OK, "a", ""), Verdict(FAIL, "b", "")]) == 1


def test_permission_patterns_cover_subjects():
    assert allows(["pdd.load.*.*"], "pdd.load.main_decode.*")
    assert allows(["pdd.load.router.*"], "pdd.load.router.*")
    assert not allows(["pdd.load.router.*"], "pdd.load.main_decode.*")
    assert allows(["_INBOX.>"], "_INBOX.abc.def") and not allows(["pdd.traces.*.get"], "pdd.traces.dc-b")


def test_env_file_relative_paths_and_the_service_it_names(tmp_path: Path):
    f = tmp_path / "router.env"
    f.write_text(
        "# dc-a router\n\nPDD_ROUTER_TLS_CERT='router.pem'\n"
        'PDD_ROUTER_NATS_URL="tls://10.200.0.1:4222"\nPDD_ROUTER_TLS_CA=/abs/ca.pem\n'
    )
    env = parse_env_file(f)
    assert env["PDD_ROUTER_TLS_CERT"] == str(tmp_path / "router.pem")
    assert env["PDD_ROUTER_TLS_CA"] == "/abs/ca.pem" and env["PDD_ROUTER_NATS_URL"] == "tls://10.200.0.1:4222"
    assert service_of(env) == "router"
