"""The router's view of the KV blocks each MD holds, fed by MD's KV events."""

from services.router.prefix_index import PrefixIndex


def test_prefix_index_leading_run():
    idx = PrefixIndex()
    idx.apply("md0", stored=[1, 2, 3, 9], evicted=[])
    assert idx.cached_prefix_blocks("md0", [1, 2, 3, 4]) == 3
    idx.apply("md0", stored=[], evicted=[2])
    assert idx.cached_prefix_blocks("md0", [1, 2, 3, 4]) == 1
    idx.apply("md0", stored=[7], evicted=[], reset=True)
    assert idx.cached_prefix_blocks("md0", [1]) == 0 and idx.size("md0") == 1
    assert idx.cached_prefix_blocks("other", [1]) == 0
