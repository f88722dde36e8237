"""The relay's request life without a server: events in, actions out (services/relay/core.py)."""

from __future__ import annotations

import time

import pytest

from services.relay.core import Begin, Drop, Fail, GoSolo, Handoff, RelayCore, Unpin
from services.relay.job import RelayState
from shared.bus.messages import Abort, AbortReason, KVReady, MainDecodeLost, RelayStart, Role
from shared.engine import SamplingParams


def start(rid: str = "r", threshold: int | None = None) -> RelayStart:
    return RelayStart(rid, [1, 2, 3], 4, SamplingParams(max_tokens=8), threshold, router="router-0")


def core(aborted: set[str] | None = None) -> RelayCore:
    return RelayCore({}, aborted if aborted is not None else set(), catchup_threshold=64)


@pytest.mark.parametrize("kv_first", [True, False])
def test_a_request_begins_once_both_halves_are_in_whichever_came_first(kv_first: bool) -> None:
    c = core()
    first = c.kv_landed("r") if kv_first else c.relay_start(start())
    assert first == [] and "r" not in c.jobs
    (begin,) = c.relay_start(start()) if kv_first else c.kv_landed("r")
    assert isinstance(begin, Begin) and not begin.handoff and c.jobs["r"] is begin.job
    assert begin.job.router == "router-0" and begin.job.catchup_threshold == 64


def test_a_late_half_of_an_ended_request_starts_nothing() -> None:
    c = core()
    c.kv_landed("r")
    (begin,) = c.relay_start(start())
    assert c.forget(begin.job) and not c.forget(begin.job)  # forgotten once
    assert c.relay_start(start()) == [] and c.kv_landed("r") == []  # a repeat, a resent landing
    assert "r" not in c.jobs and "r" not in c.early.start and "r" not in c.early.landed


def test_an_aborted_request_neither_starts_nor_takes_its_kv() -> None:
    c = core(aborted={"r"})
    assert c.relay_start(start()) == []
    with pytest.raises(ValueError, match="aborted"):
        c.kv_landed("r")


def test_kv_ready_before_the_start_hands_over_as_it_begins_and_only_once() -> None:
    c = core()
    assert c.kv_ready(KVReady("r", "md-1")) == []
    c.kv_landed("r")
    (begin,) = c.relay_start(start(threshold=5))
    assert begin.handoff and begin.job.md_instance == "md-1" and begin.job.catchup_threshold == 5
    assert begin.job.state.is_in(RelayState.HANDING_OFF)
    assert c.kv_ready(KVReady("r", "md-1")) == []  # a duplicate starts no second handoff


def test_kv_ready_while_relaying_starts_the_handoff() -> None:
    c = core()
    c.kv_landed("r")
    (begin,) = c.relay_start(start())
    assert c.kv_ready(KVReady("r", "md-2")) == [Handoff(begin.job)] and begin.job.md_instance == "md-2"


def test_md_lost_late_or_giving_up_sends_the_relay_solo() -> None:
    c = core()
    for rid, event in [
        ("a", lambda c, job: c.md_lost(MainDecodeLost("a", "md-1"))),
        ("b", lambda c, job: c.md_deadline(job)),
        ("c", lambda c, job: c.abort(Abort("c", AbortReason.FAILED, "x"), Role.MAIN_DECODE)),
    ]:
        c.kv_landed(rid)
        (begin,) = c.relay_start(start(rid))
        (solo,) = event(c, begin.job)
        assert isinstance(solo, GoSolo) and begin.job.state.is_in(RelayState.SOLO)
        again = event(c, begin.job)  # solo already: MD's word changes nothing, an abort ends it
        assert again == ([Drop(begin.job)] if rid == "c" else [])


def test_an_abort_from_another_role_drops_the_job_or_unpins_landed_kv() -> None:
    c = core()
    c.kv_landed("r")
    assert c.abort(Abort("r", AbortReason.ROUTER_LOST), Role.ROUTER) == [Unpin("r")]
    assert "r" not in c.early.landed
    c.kv_landed("s")
    (begin,) = c.relay_start(start("s"))
    assert c.abort(Abort("s", AbortReason.CLIENT_GONE), Role.ROUTER) == [Drop(begin.job)]
    assert "s" not in c.jobs and begin.job.state.is_in(RelayState.DONE)


def test_expiry_unpins_kv_whose_start_never_came_and_fails_requests_past_the_timeout() -> None:
    c = core()
    c.kv_landed("lonely")
    c.kv_landed("r")
    (begin,) = c.relay_start(start())
    now = time.monotonic()
    assert c.expire(now, timeout_s=30.0) == []
    assert c.expire(now + 10.0, timeout_s=30.0) == [Unpin("lonely")]
    assert c.expire(now + 31.0, timeout_s=30.0) == [Fail(begin.job, "request timed out on the relay")]
