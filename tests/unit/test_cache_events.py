"""What an instance tells the routers about its prefix cache: each hash once per message, with
its last change (a block evicted and stored again within one message is in the cache)."""

from shared.serving.cache_events import last_changes


def test_each_hash_counts_once_with_its_last_change() -> None:
    events = [("stored", 1), ("evicted", 1), ("evicted", 2), ("stored", 2), ("stored", 3), ("evicted", 4)]
    assert last_changes(events) == ([2, 3], [1, 4])
    assert last_changes([]) == ([], [])
