"""The in-flight rule: a block on its way to a decoder is carried once, by one request."""

import pytest

from shared.engine.in_flight import BlocksInFlight


def test_a_second_request_waits_for_blocks_already_in_flight():
    f = BlocksInFlight()
    assert f.claim("a", [1, 2, 3]) == ([1, 2, 3], [])
    assert f.claim("b", [1, 2, 3, 4]) == ([4], [1, 2, 3])
    assert f.waiting("b") == {1, 2, 3}
    assert f.landed("a", [1, 2]) == {"b": [1, 2]}
    assert f.waiting("b") == {3}
    assert f.landed("a", [3]) == {"b": [3]}
    assert f.waiting("b") == set() and len(f) == 1  # only b's own block 4 is still in flight
    assert f.landed("b", [4]) == {} and len(f) == 0


def test_a_carrier_that_drops_out_loses_its_owed_blocks_to_every_waiter():
    f = BlocksInFlight()
    f.claim("a", [1, 2, 3])
    f.claim("b", [1, 2, 5])
    f.claim("c", [1, 2, 3, 6])
    f.landed("a", [1])
    assert f.dropped("a") == {"b": [2], "c": [2, 3]}
    assert f.waiting("b") == set() and f.waiting("c") == set()
    # What a lost carrier owed is no longer in flight: the next request carries it itself.
    assert f.claim("d", [2, 3]) == ([2, 3], [])


def test_a_waiter_that_leaves_waits_for_nothing_and_carries_nothing():
    f = BlocksInFlight()
    f.claim("a", [1])
    f.claim("b", [1, 2])
    assert f.dropped("b") == {}
    assert f.landed("a", [1]) == {}
    assert len(f) == 0 and not f.awaits and not f.carries


def test_a_request_claims_once_and_repeated_hashes_count_once():
    f = BlocksInFlight()
    assert f.claim("a", [7, 7, 8]) == ([7, 8], [])
    with pytest.raises(ValueError):
        f.claim("a", [9])
    assert f.landed("zzz", [7]) == {}  # a request that carries nothing brings nothing
