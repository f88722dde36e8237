"""The router's bookkeeping of numbered cache events (services/router/routing/cache_view.py): when the
numbering breaks it asks for a snapshot, once; the snapshot replaces the view and only the
messages after it apply."""

from __future__ import annotations

from services.router.routing.cache_view import BUFFER_MAX, CacheView
from services.router.routing.prefix_index import PrefixIndex
from shared.bus.messages import KVEvents, KVSnapshot, Role

MD = Role.MAIN_DECODE


def ev(seq: int, stored=(), evicted=(), epoch: str = "e1", inst: str = "0") -> KVEvents:
    return KVEvents(MD, inst, epoch, seq, list(stored), list(evicted))


def snap(seq: int, stored=(), epoch: str = "e1", inst: str = "0") -> KVSnapshot:
    return KVSnapshot(MD, inst, epoch, seq, list(stored))


def blocks(index: PrefixIndex, inst: str = "0") -> set[int]:
    return set(index.blocks(inst))


def synced(seq: int = 0, stored=(), epoch: str = "e1") -> tuple[CacheView, PrefixIndex]:
    index = PrefixIndex()
    view = CacheView(index)
    assert view.on_events(ev(seq, epoch=epoch))  # first contact
    assert not view.on_snapshot(snap(seq, stored, epoch))
    return view, index


def test_first_contact_asks_once_and_buffers_until_the_snapshot() -> None:
    index = PrefixIndex()
    view = CacheView(index)
    assert view.on_events(ev(5, stored=[50]))  # never met: ask
    assert not view.on_events(ev(6, stored=[60]))  # one fetch at a time
    assert view.syncing("0") and blocks(index) == set()  # nothing applied before the snapshot
    assert not view.on_snapshot(
        snap(4, stored=[1])
    )  # older than the message that asked: that one applies too
    assert blocks(index) == {1, 50, 60} and not view.syncing("0")


def test_the_next_message_applies_and_an_old_one_is_dropped() -> None:
    view, index = synced(3, stored=[1, 2])
    assert not view.on_events(ev(4, stored=[7], evicted=[1]))
    assert blocks(index) == {2, 7}
    assert not view.on_events(ev(4, stored=[99])) and not view.on_events(ev(2, evicted=[2]))  # repeats
    assert blocks(index) == {2, 7} and not view.syncing("0")
    assert not view.on_events(ev(5)) and view.feeds["0"].seq == 5  # an empty tick still counts


def test_a_skipped_number_asks_for_a_snapshot() -> None:
    view, index = synced(0)
    assert not view.on_events(ev(1, stored=[1]))
    assert not view.on_events(ev(2, stored=[2]))
    assert view.on_events(ev(4, stored=[4]))  # 3 was lost
    assert blocks(index) == {1, 2}  # 4 waits for the snapshot
    assert not view.on_events(ev(5, stored=[5]))
    assert not view.on_snapshot(snap(4, stored=[1, 2, 3, 4]))  # as of 4: only 5 applies on top
    assert blocks(index) == {1, 2, 3, 4, 5} and view.feeds["0"].seq == 5


def test_a_restart_asks_for_a_snapshot_even_with_the_next_number() -> None:
    view, index = synced(7, stored=[1, 2])
    assert view.on_events(ev(8, stored=[3], epoch="e2"))  # another process: its seq 8 is no follow-up
    assert not view.on_snapshot(snap(8, stored=[3], epoch="e2"))
    assert blocks(index) == {3} and view.feeds["0"].epoch == "e2"


def test_a_break_among_the_buffered_messages_asks_again_and_clears_the_buffer() -> None:
    view, index = synced(0)
    assert view.on_events(ev(3))  # 1 and 2 lost
    view.on_events(ev(4, stored=[4]))
    view.on_events(ev(6, stored=[6]))  # 5 lost too
    assert view.on_snapshot(snap(3, stored=[1]))  # 4 applies, then 6 does not follow: ask again
    assert blocks(index) == {1, 4} and view.syncing("0") and not view.feeds["0"].buffer
    assert not view.on_snapshot(snap(6, stored=[1, 4, 6]))
    assert blocks(index) == {1, 4, 6} and not view.syncing("0")


def test_an_unasked_or_forgotten_snapshot_changes_nothing() -> None:
    view, index = synced(1, stored=[1])
    assert not view.on_snapshot(snap(9, stored=[9]))  # not syncing: not asked for
    assert blocks(index) == {1}
    assert view.on_events(ev(3))
    view.forget("0")
    assert not view.on_snapshot(snap(3, stored=[3])) and blocks(index) == set() and "0" not in view.feeds


def test_resync_marks_every_idle_instance_once() -> None:
    view, _ = synced(0)
    assert view.on_events(ev(1, inst="1"))  # instance 1 is syncing already
    assert view.resync() == ["0"] and view.resync() == []
    assert view.syncing("0") and not view.on_events(ev(1, stored=[1]))  # buffered meanwhile
    assert not view.on_snapshot(snap(0)) and view.feeds["0"].seq == 1


def test_the_buffer_is_bounded_and_an_overflow_only_costs_another_snapshot() -> None:
    view, index = synced(0)
    assert view.on_events(ev(2))
    for seq in range(3, BUFFER_MAX + 10):
        view.on_events(ev(seq, stored=[seq]))
    assert len(view.feeds["0"].buffer) == BUFFER_MAX
    assert view.on_snapshot(snap(2))  # the oldest buffered were dropped: 3 is missing
    assert not view.on_snapshot(snap(BUFFER_MAX + 9, stored=[1]))
    assert blocks(index) == {1}


def test_messages_of_a_process_gone_meanwhile_cost_one_more_snapshot_not_one_each() -> None:
    view, index = synced(0)
    assert view.on_events(ev(2))  # 1 lost
    for seq in (3, 4):
        view.on_events(ev(seq, stored=[seq]))  # still the old process
    view.on_events(ev(1, stored=[11], epoch="e2"))  # it restarted
    assert view.on_snapshot(snap(1, stored=[11], epoch="e2"))  # the old process's messages break the feed
    assert not view.on_snapshot(snap(1, stored=[11], epoch="e2"))  # and are gone with the next one
    assert blocks(index) == {11}
