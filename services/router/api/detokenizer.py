"""Incremental text for a growing token list, with OpenAI stop-string semantics."""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.tokens: list[int] = []
        self.emitted = ""  # text already given to the client
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the new text that is safe to emit."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
                self.stopped = True
        if not self.stopped:
            # Hold back an incomplete multi-byte character and a possible stop-string start.
            text = text.rstrip("\ufffd")
            hold = max((_overlap(text, s) for s in self.stop), default=0)
            text = text[: len(text) - hold]
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += new
        return new

    def flush(self) -> str:
        """At the end, emit whatever was held back."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.tokens)
        new = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += new
        return new


def _overlap(text: str, stop: str) -> int:
    """Longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
