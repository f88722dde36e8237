"""Incremental text for a growing token list, with OpenAI stop-string semantics.

Each call decodes only a short window, never the whole output: the tokens since the last
stable point, after the tokens of the chunk before it as context (a token's text may depend
on the one before it: a leading space dropped at the start, bytes of one character split over
tokens). The text up to a stable point (one where the new text did not end in a partial
character) is kept; what the client gets is what decoding everything would give.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what decode gives for bytes that are not (yet) a whole character


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        # A stop string counts only if it ends after the text of the first min_tokens tokens.
        self.min_tokens = min_tokens
        self._floor: int | None = 0 if min_tokens == 0 else None  # that text's length, once known
        self.tokens: list[int] = []
        self.emitted = ""  # text already given to the client
        self.stopped = False
        # The decoded text is emitted[:_base] + _text + the text of tokens[_read:], decoded
        # after the context tokens[_prefix:_read].
        self._base = 0
        self._text = ""
        self._prefix = self._read = 0
        self._prefix_text = ""  # decode(tokens[_prefix:_read])

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the new text that is safe to emit."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self._window()  # the decoded text from _base on
        if self._floor is None and len(self.tokens) > self.min_tokens:
            self._floor = len(self.tokenizer.decode(self.tokens[: self.min_tokens]))
        for s in self.stop if self._floor is not None else ():
            cut = text.find(s, max(0, self._floor - self._base - len(s) + 1))
            if cut >= 0:
                text = text[:cut]
                self.stopped = True
        if not self.stopped:
            # Hold back an incomplete multi-byte character and a possible stop-string start.
            text = text.rstrip(REPLACEMENT)
            hold = max((_overlap(text, s) for s in self.stop), default=0)
            text = text[: len(text) - hold]
        new = self._emit(text)
        self._forget_emitted()
        return new

    def flush(self) -> str:
        """At the end, emit whatever was held back."""
        if self.stopped:
            return ""
        return self._emit(self._window())

    def _emit(self, text: str) -> str:
        """What `text` (the decoded text from _base on) adds to what was emitted."""
        done = self.emitted[self._base :]
        new = text[len(done) :] if text.startswith(done) else ""
        self.emitted += new
        return new

    def _window(self) -> str:
        """The decoded text from _base on. The new tokens become context once their text is whole."""
        window = self.tokenizer.decode(self.tokens[self._prefix :])
        if not window.startswith(self._prefix_text):  # the new tokens changed the context's text
            return self.tokenizer.decode(self.tokens)[self._base :]
        tail = window[len(self._prefix_text) :]
        text = self._text + tail
        if tail and not tail.endswith(REPLACEMENT):
            self._text = text
            self._prefix, self._read = self._read, len(self.tokens)
            self._prefix_text = self.tokenizer.decode(self.tokens[self._prefix : self._read])
        return text

    def _forget_emitted(self) -> None:
        """Drop the kept text once emitted: no stop string starts in it (one that did would have
        been held back with it, or found)."""
        keep_from = min(len(self.emitted), self._base + len(self._text))
        if keep_from > self._base:
            self._text = self._text[keep_from - self._base :]
            self._base = keep_from


def _overlap(text: str, stop: str) -> int:
    """Longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
