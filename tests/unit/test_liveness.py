"""Liveness from heartbeats: a silent peer is lost only while the observer itself was up."""

from shared.serving.liveness import ConnectionWatch, Heartbeats, is_lost


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Link:
    """The two things ConnectionWatch reads from a nats-py Client (a real client cannot be
    cut on cue here; tests/e2e/test_e2e_faults.py restarts a real server)."""

    def __init__(self) -> None:
        self.is_connected = True
        self.stats = {"reconnects": 0}


def test_silence_counts_only_beyond_the_bound_and_only_while_the_observer_was_up() -> None:
    assert not is_lost(last_heard=10.0, now=12.0, lost_after_s=2.0, observer_up_for=60.0)
    assert is_lost(last_heard=10.0, now=12.1, lost_after_s=2.0, observer_up_for=60.0)
    assert not is_lost(last_heard=10.0, now=30.0, lost_after_s=2.0, observer_up_for=1.5)


def test_heartbeats_notice_a_peer_never_heard_since_the_start_and_prune_old_ones() -> None:
    clock = Clock()
    hb = Heartbeats(lost_after_s=4.0, clock=clock)
    hb.heard("a")
    clock.t += 3.0
    hb.heard("b")
    clock.t += 1.5  # a: 4.5 s silent, b: 1.5 s, c: never heard (4.5 s since the start)
    assert hb.lost(["a", "b", "c"], observer_up_for=100.0) == {"a", "c"}
    assert hb.lost(["a", "b", "c"], observer_up_for=3.0) == set()
    hb.prune(keep_s=2.0)
    assert len(hb) == 1 and hb.lost(["b"], 100.0) == set()


def test_connection_watch_restarts_its_count_on_a_drop_or_a_reconnect_between_polls() -> None:
    clock, link = Clock(), Link()
    watch = ConnectionWatch(link, clock=clock, frozen_after_s=20)
    clock.t += 10
    assert watch.up_for() == 10
    link.stats["reconnects"] = 1  # a blip shorter than the polling interval
    assert watch.up_for() == 0
    clock.t += 3
    assert watch.up_for() == 3
    link.is_connected = False
    assert watch.up_for() == 0
    clock.t += 5
    link.is_connected = True
    assert watch.up_for() == 0
    clock.t += 1
    assert watch.up_for() == 1


def test_an_observer_that_was_frozen_does_not_trust_the_silence_it_slept_through() -> None:
    clock, link = Clock(), Link()
    watch = ConnectionWatch(link, clock=clock, frozen_after_s=2.0)
    for _ in range(10):
        clock.t += 0.5
        watch.up_for()
    assert watch.up_for() == 5.0
    clock.t += 6.0  # SIGSTOP, or a pause: no poll for 6 s
    assert watch.up_for() == 0
    clock.t += 0.5
    assert watch.up_for() == 0.5
