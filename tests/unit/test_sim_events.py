"""The simulator's event loop: time order, then insertion order; cancel; a time limit."""

from pdd.sim.fleet.events import EventLoop


def test_events_run_by_time_then_insertion():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append(("b", loop.now)))
    loop.at(1.0, lambda: seen.append(("a1", loop.now)))
    loop.at(1.0, lambda: seen.append(("a2", loop.now)))
    loop.after(
        0.5, lambda: loop.after(0.5, lambda: seen.append(("a3", loop.now)))
    )  # set at 0.5 for 1.0: after a1, a2
    loop.run()
    assert seen == [("a1", 1.0), ("a2", 1.0), ("a3", 1.0), ("b", 2.0)]
    assert loop.events == 5


def test_cancel_and_time_limit():
    loop, seen = EventLoop(), []
    handle = loop.at(1.0, lambda: seen.append("cancelled"))
    loop.at(2.0, lambda: seen.append("kept"))
    loop.at(5.0, lambda: seen.append("too late"))
    loop.cancel(handle)
    loop.run(until=3.0)
    assert seen == ["kept"] and loop.now == 3.0
    loop.run()
    assert seen == ["kept", "too late"] and loop.now == 5.0


def test_an_event_set_in_the_past_runs_now():
    loop, seen = EventLoop(), []
    loop.at(1.0, lambda: loop.at(0.5, lambda: seen.append(loop.now)))
    loop.run()
    assert seen == [1.0]
