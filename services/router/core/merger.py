"""Merges indexed token events from several instances into one ordered stream."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.logprobs import TokenLogprobs


@dataclass
class MergeResult:
    tokens: list[int] = field(default_factory=list)  # newly released, in index order
    finished: bool = False
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # with tokens (None: not carried)


class TokenMerger:
    """Emits each output index exactly once and in order, whoever produced it.

    Relay and MD may both report the same index around a handoff; duplicates are
    dropped. A finish marker ends the stream only once every earlier index arrived.
    Indexes at or past the request's `max_tokens` are never held: whatever an event
    claims, the merger keeps at most `max_tokens` tokens.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._pending: dict[int, tuple[int, TokenLogprobs | None]] = {}  # index -> token, its logprobs
        self.next_index = 0  # first index not yet released
        self.released: list[int] = []  # every token released so far, in order
        self.end_index: int | None = None  # one past the last token, once known
        self.finish_reason: str | None = None
        self.duplicates = 0

    def add(
        self,
        index: int,
        tokens: list[int],
        finished: bool = False,
        finish_reason: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> MergeResult:
        """`logprobs[i]` (if given) goes with tokens[i], and is released with it."""
        for i, tok in enumerate(tokens[: max(0, self.max_tokens - index)]):
            idx = index + i
            if idx < self.next_index or idx in self._pending:
                self.duplicates += 1
                continue
            if self.end_index is not None and idx >= self.end_index:
                continue  # past a finish already seen: a late producer's extra token
            self._pending[idx] = (tok, logprobs[i] if logprobs and i < len(logprobs) else None)
        if finished:
            end = min(index + len(tokens), self.max_tokens)
            if self.end_index is None or end < self.end_index:
                self.end_index = end
                self.finish_reason = finish_reason
                for idx in [i for i in self._pending if i >= end]:
                    del self._pending[idx]
        out = MergeResult()
        while self.next_index in self._pending:
            tok, lp = self._pending.pop(self.next_index)
            out.tokens.append(tok)
            out.logprobs.append(lp)
            self.next_index += 1
        self.released.extend(out.tokens)
        out.finished = self.finished
        return out

    @property
    def finished(self) -> bool:
        """Every token up to the finish was released."""
        return self.end_index is not None and self.next_index >= self.end_index

    @property
    def has_gap(self) -> bool:
        """Tokens past a missing index are waiting (a lost message, or one still on its way)."""
        return bool(self._pending)

    def restart_at_released(self) -> None:
        """The request moves to another instance, which continues from the released tokens:
        forget what the old one sent beyond them (and its finish, if seen)."""
        self._pending.clear()
        self.end_index, self.finish_reason = None, None
