"""Token merger, MD prefix index and detokenizer of the router."""

from services.router.detokenizer import Detokenizer
from services.router.merger import TokenMerger
from services.router.prefix_index import PrefixIndex


def test_in_order_from_several_producers_with_duplicates():
    m = TokenMerger()
    assert m.add(0, [10]).tokens == [10]  # prefill's first token
    assert m.add(3, [13, 14]).tokens == []  # MD is ahead of the relay's last delivery
    r = m.add(1, [11, 12, 13])  # relay, overlapping MD
    assert r.tokens == [11, 12, 13, 14]
    assert m.duplicates == 1
    r = m.add(5, [15], finished=True, finish_reason="length")
    assert r.tokens == [15] and r.finished and m.finish_reason == "length"


def test_finish_waits_for_missing_indices_and_drops_late_tokens():
    m = TokenMerger()
    r = m.add(2, [], finished=True, finish_reason="stop")
    assert not r.finished
    assert m.add(0, [1]).tokens == [1]
    r = m.add(1, [2, 3, 4])  # index 2, 3 are past the end
    assert r.tokens == [2] and r.finished


def test_prefix_index_leading_run():
    idx = PrefixIndex()
    idx.apply("md0", stored=[1, 2, 3, 9], evicted=[])
    assert idx.cached_prefix_blocks("md0", [1, 2, 3, 4]) == 3
    idx.apply("md0", stored=[], evicted=[2])
    assert idx.cached_prefix_blocks("md0", [1, 2, 3, 4]) == 1
    idx.apply("md0", stored=[7], evicted=[], reset=True)
    assert idx.cached_prefix_blocks("md0", [1]) == 0 and idx.size("md0") == 1
    assert idx.cached_prefix_blocks("other", [1]) == 0


class _Bytes:
    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_holds_partial_utf8_and_stop_prefix():
    d = Detokenizer(_Bytes(), stop=["END"])
    euro = list("€".encode())
    assert d.add(list(b"a") + euro[:2]) == "a"
    assert d.add(euro[2:]) == "€"
    assert d.add(list(b"xE")) == "x"  # "E" may start "END": held back
    assert d.add(list(b"N")) == ""  # "EN" still may
    assert d.add(list(b"D!")) == "" and d.stopped
    assert d.emitted == "a€x"


def test_detokenizer_flush_releases_held_text():
    d = Detokenizer(_Bytes(), stop=["END"])
    d.add(list(b"abE"))
    assert d.flush() == "E"
    assert d.emitted == "abE"
