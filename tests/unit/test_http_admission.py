"""The router's admission control: a bounded number in flight, a bounded FIFO wait, and
no slot ever lost or doubled, also when a wait ends just as a slot is handed over."""

from __future__ import annotations

import asyncio

import pytest

from services.router.api.http_admission import Admission, Overloaded


async def test_in_flight_and_waiting_are_bounded_and_waiters_go_in_order():
    adm = Admission(max_in_flight=2, max_waiting=2, max_wait_s=60)
    await adm.acquire()
    await adm.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await adm.acquire()
        order.append(name)

    first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    assert adm.in_flight == 2 and adm.waiting == 2
    with pytest.raises(Overloaded):
        await adm.acquire()  # the queue is full: turned away at once
    adm.release()
    await first
    assert order == ["first"] and adm.in_flight == 2 and adm.waiting == 1
    adm.release()
    await second
    assert order == ["first", "second"] and adm.waiting == 0
    for _ in range(2):
        adm.release()
    assert adm.in_flight == 0


async def test_a_wait_that_runs_out_is_overloaded_and_leaves_the_queue():
    adm = Admission(max_in_flight=1, max_waiting=4, max_wait_s=0.01)
    await adm.acquire()
    with pytest.raises(Overloaded):
        await adm.acquire()  # nobody releases
    assert adm.waiting == 0 and adm.in_flight == 1
    adm.release()
    await adm.acquire()  # the slot is free again
    assert adm.in_flight == 1


async def test_a_waiter_cancelled_as_it_is_handed_a_slot_passes_the_slot_on():
    adm = Admission(max_in_flight=1, max_waiting=4, max_wait_s=60)
    await adm.acquire()
    handed, next_in_line = asyncio.create_task(adm.acquire()), asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    adm.release()  # the slot goes to `handed`...
    handed.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await handed
    await next_in_line  # it got the slot `handed` gave back
    assert adm.in_flight == 1 and adm.waiting == 0
    adm.release()
    assert adm.in_flight == 0


async def test_no_queue_means_turned_away_at_once():
    adm = Admission(max_in_flight=1, max_waiting=0, max_wait_s=60)
    await adm.acquire()
    with pytest.raises(Overloaded):
        await adm.acquire()
