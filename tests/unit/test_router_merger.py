"""The router's token merger: one ordered stream from prefill, relay and MD token events."""

from services.router.core.merger import TokenMerger


def test_in_order_from_several_producers_with_duplicates():
    m = TokenMerger(max_tokens=64)
    assert m.add(0, [10]).tokens == [10]  # prefill's first token
    assert m.add(3, [13, 14]).tokens == []  # MD is ahead of the relay's last delivery
    r = m.add(1, [11, 12, 13])  # relay, overlapping MD
    assert r.tokens == [11, 12, 13, 14]
    assert m.duplicates == 1
    r = m.add(5, [15], finished=True, finish_reason="length")
    assert r.tokens == [15] and r.finished and m.finish_reason == "length"


def test_finish_waits_for_missing_indices_and_drops_late_tokens():
    m = TokenMerger(max_tokens=64)
    r = m.add(2, [], finished=True, finish_reason="stop")
    assert not r.finished
    assert m.add(0, [1]).tokens == [1]
    r = m.add(1, [2, 3, 4])  # index 2, 3 are past the end
    assert r.tokens == [2] and r.finished


def test_earlier_finish_reported_later_wins():
    # MD reports its end at 12 first; the relay then reports that the stream ended at 10.
    m = TokenMerger(max_tokens=64)
    assert m.add(0, [100]).tokens == [100]  # prefill's first token
    r = m.add(5, list(range(105, 112)), finished=True, finish_reason="length")  # indices 5..11, end 12
    assert r.tokens == [] and not r.finished  # indices 1..4 are still missing
    r = m.add(1, list(range(101, 110)), finished=True, finish_reason="stop")  # indices 1..9, end 10
    assert r.tokens == list(range(101, 110)) and r.finished
    assert m.finish_reason == "stop"
    assert m.add(10, [110, 111]).tokens == []  # MD's tokens past the earliest end never come out


def test_later_finish_after_the_earliest_changes_nothing():
    m = TokenMerger(max_tokens=64)
    m.add(0, [100])
    r = m.add(1, list(range(101, 110)), finished=True, finish_reason="stop")  # end 10
    assert r.tokens == list(range(101, 110)) and r.finished
    r = m.add(5, list(range(105, 112)), finished=True, finish_reason="length")  # end 12, too late
    assert r.tokens == [] and r.finished
    assert m.finish_reason == "stop"


def test_indexes_at_or_past_max_tokens_are_never_held():
    m = TokenMerger(max_tokens=8)
    assert m.add(10**12, [1] * 1000).tokens == []  # a forged far-away index: nothing kept
    assert m.add(6, [16, 17, 18, 19]).tokens == []  # only indexes 6 and 7 are kept
    assert len(m._pending) == 2
    r = m.add(0, list(range(10, 16)), finished=False)
    assert r.tokens == [10, 11, 12, 13, 14, 15, 16, 17] and not r.finished
    assert m._pending == {}


def test_a_finish_claimed_past_max_tokens_ends_at_max_tokens():
    m = TokenMerger(max_tokens=3)
    r = m.add(0, [1, 2, 3, 4, 5], finished=True, finish_reason="length")
    assert r.tokens == [1, 2, 3] and r.finished and m.end_index == 3
