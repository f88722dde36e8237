"""The router's incremental detokenizer: partial UTF-8 and stop strings are held back."""

from services.router.api.detokenizer import Detokenizer
from shared.model.tokenizer import ByteTokenizer


def test_detokenizer_holds_partial_utf8_and_stop_prefix():
    d = Detokenizer(ByteTokenizer(), stop=["END"])
    euro = list("€".encode())
    assert d.add(list(b"a") + euro[:2]) == "a"
    assert d.add(euro[2:]) == "€"
    assert d.add(list(b"xE")) == "x"  # "E" may start "END": held back
    assert d.add(list(b"N")) == ""  # "EN" still may
    assert d.add(list(b"D!")) == "" and d.stopped
    assert d.emitted == "a€x"


def test_detokenizer_flush_releases_held_text():
    d = Detokenizer(ByteTokenizer(), stop=["END"])
    d.add(list(b"abE"))
    assert d.flush() == "E"
    assert d.emitted == "abE"
