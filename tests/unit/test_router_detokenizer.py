"""The router's incremental detokenizer: partial UTF-8 and stop strings are held back, and what
it emits, call by call, is what decoding the whole output each time gives (byte tokenizer,
byte-level BPE, and a sentencepiece-style tokenizer with byte fallback)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.router.api.detokenizer import Detokenizer
from shared.model.tokenizer import ByteTokenizer

WORDS = ["the", "cat", "é", "naïve", "日本語", "🙂", "END", "stop", "\n", "  ", "a.b", "«»", "x"]


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


class FullDecode:
    """The reference: decode the whole output at every call, then the same rules."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop, self.tokens, self.emitted, self.stopped = tokenizer, stop, [], "", False

    def add(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text, self.stopped = text[:cut], True
        if not self.stopped:
            text = text.rstrip("\ufffd")
            hold = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text = text[: len(text) - hold]
        return self._new(text)

    def flush(self) -> str:
        return "" if self.stopped else self._new(self.tokenizer.decode(self.tokens))

    def _new(self, text: str) -> str:
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += new
        return new


class HF:
    """A `tokenizers` tokenizer as shared.model.tokenizer.HFTokenizer decodes with it."""

    def __init__(self, tk: Tokenizer):
        self.tk = tk

    def decode(self, ids: list[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text).ids


def _corpus(rng: random.Random, n: int) -> list[str]:
    return [
        "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 12)))
        for _ in range(n)
    ]


def byte_level_bpe() -> HF:
    """GPT-2 / Llama-3 style: byte-level pieces, merges that span several bytes of a character."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tk.train_from_iterator(_corpus(random.Random(1), 300), trainer)
    return HF(tk)


def sentencepiece_style() -> HF:
    """Llama-2 / Mistral style: "▁" for spaces (the first one stripped) and <0xNN> byte tokens
    for what the vocabulary lacks."""
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(
        _corpus(random.Random(2), 300), trainers.BpeTrainer(vocab_size=150, limit_alphabet=20)
    )
    model = json.loads(base.to_str())["model"]
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({piece: 256 + i for i, piece in enumerate(model["vocab"])})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tk = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return HF(tk)


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    """ids as the router gets them: one to a few tokens per message."""
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(ids[i : i + n])
        i += n
    return out


def _emits(det, chunks: list[list[int]]) -> list:
    """What a detokenizer says after each chunk (text, stopped), at the flush, and at the end."""
    said = [(det.add(chunk), det.stopped) for chunk in chunks]
    return [*said, det.flush(), det.emitted, det.tokens]


def _compare(tokenizer, ids: list[int], stop: list[str], rng: random.Random) -> tuple[list, list]:
    """The incremental detokenizer's and full decoding's answers, call by call."""
    chunks = _chunks(ids, rng)
    return _emits(Detokenizer(tokenizer, stop), chunks), _emits(FullDecode(tokenizer, stop), chunks)


def _stops(rng: random.Random, text: str) -> list[str]:
    """None, some from the text itself (so they hit), some that never appear."""
    stops = []
    for _ in range(rng.randint(0, 3)):
        if text and rng.random() < 0.7:
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 4)])
        else:
            stops.append(rng.choice(["END", "é!", "🙂🙂", "\n\n", "zz"]))
    return [s for s in stops if s]


def test_byte_tokenizer_emits_what_full_decoding_emits():
    rng = random.Random(7)
    tok = ByteTokenizer()
    pieces = [
        b"a",
        b" ",
        b"E",
        b"N",
        b"D",
        "é".encode(),
        "€".encode(),
        "日".encode(),
        "🙂".encode(),
        b"\xff",
        b"\x80",
        b"\xe2\x82",
        b"\xf0\x9f",
    ]
    for _ in range(400):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        ids = list(data)
        for _ in range(rng.randint(0, 2)):  # BOS / EOS ids decode to nothing
            ids.insert(rng.randint(0, len(ids)), rng.choice([256, 257]))
        new, ref = _compare(tok, ids, _stops(rng, data.decode("utf-8", errors="replace")), rng)
        assert new == ref, ids


@pytest.mark.parametrize("make", [byte_level_bpe, sentencepiece_style])
def test_checkpoint_tokenizers_emit_what_full_decoding_emits(make):
    tokenizer, rng = make(), random.Random(11)
    for text in _corpus(rng, 300):
        ids = tokenizer.encode(text)
        new, ref = _compare(tokenizer, ids, _stops(rng, text), rng)
        assert new == ref, ids


def test_byte_level_ids_in_any_order_emit_what_full_decoding_emits():
    """Byte-level pieces in any order (a sampled model may split a character anywhere)."""
    tokenizer, rng = byte_level_bpe(), random.Random(13)
    vocab = tokenizer.tk.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 25))]
        new, ref = _compare(tokenizer, ids, _stops(rng, tokenizer.decode(ids)), rng)
        assert new == ref, ids


def test_long_outputs_decode_a_short_window_each_time():
    calls: list[int] = []

    class Counting(ByteTokenizer):
        def decode(self, ids: list[int]) -> str:
            calls.append(len(ids))
            return super().decode(ids)

    d = Detokenizer(Counting(), stop=["END"])
    text = "é日 x" * 500
    for b in text.encode():
        d.add([b])
    assert d.flush() == "" and d.emitted == text
    assert max(calls) <= 8  # never the whole output
