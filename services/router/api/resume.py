"""Resumable streams. Every SSE event of a streamed completion carries an `id:`

    <request id>:<tokens sent>:<seed, hex>:<digest>[:end|:usage]

the digest being a hash of the prompt and of the tokens sent so far. A client whose stream
broke (its router died) sends the same request again, to any router, with `Last-Event-ID`
set to the last id it got. That router runs the request again with the same seed: sampling
is a function of (seed, position) and the tokens before, so the run gives the same tokens;
the first `tokens sent` of them go only into the detokenizer (the client has them), their
digest must equal the one in the id (else the request is not the same: an error, never
wrong text), and the client gets the rest, from the next token on, each once. It needs no
state anywhere: not the dead router's, not the backends' (whose copy of the request, an
orphan, is dropped)."""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass

from ..core.errors import APIError
from ..core.request_stream import Delta
from .detokenizer import Detokenizer

HEADER = "last-event-id"
PHASES = ("", "end", "usage")  # tokens; the last chunk sent; the usage chunk sent too
_RID = re.compile(r"cmpl-[A-Za-z0-9_-]{1,200}")
_DIGEST = re.compile(r"[0-9a-f]{16}")


def _pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}Q", *tokens)


@dataclass(frozen=True)
class EventId:
    rid: str  # the request's id as the client knows it (its chunks' "id")
    sent: int  # tokens the client has
    seed: int
    digest: str  # of the prompt and those tokens
    phase: str = ""  # see PHASES

    def __str__(self) -> str:
        return ":".join(
            [self.rid, str(self.sent), f"{self.seed:x}", self.digest, *([self.phase] if self.phase else [])]
        )


def parse_event_id(value: str) -> EventId:
    """The EventId in a Last-Event-ID header; ValueError if it is not one of ours."""
    parts = value.strip().split(":")
    phase = parts.pop() if len(parts) == 5 and parts[-1] in PHASES[1:] else ""
    if len(parts) != 4:
        raise ValueError("not <request id>:<tokens sent>:<seed>:<digest>")
    rid, sent, seed, digest = parts
    if not _RID.fullmatch(rid) or not sent.isdigit() or not _DIGEST.fullmatch(digest):
        raise ValueError("malformed")
    try:
        seed_value = int(seed, 16)
    except ValueError:
        raise ValueError("malformed seed") from None
    if not 0 <= seed_value < 2**63 or len(sent) > 9:
        raise ValueError("out of range")
    return EventId(rid, int(sent), seed_value, digest, phase)


class Progress:
    """What one stream's client has so far, as the id of its next event."""

    def __init__(self, rid: str, seed: int, prompt_ids: list[int]) -> None:
        self.rid, self.seed, self.sent = rid, seed, 0
        self._hash = hashlib.blake2b(digest_size=8, person=b"pdd-sse-id")
        self._hash.update(_pack([len(prompt_ids), *prompt_ids]))

    def add(self, tokens: list[int]) -> None:
        self._hash.update(_pack(tokens))
        self.sent += len(tokens)

    @property
    def digest(self) -> str:
        return self._hash.copy().hexdigest()

    def event_id(self, phase: str = "") -> EventId:
        return EventId(self.rid, self.sent, self.seed, self.digest, phase)


class Replay:
    """Feeds the first `target.sent` tokens of a re-run into the detokenizer and `progress`
    only (the client has them), then checks they are the ones the client got."""

    def __init__(self, target: EventId, progress: Progress, detok: Detokenizer) -> None:
        self.target, self.progress, self.detok = target, progress, detok

    @property
    def left(self) -> int:
        return self.target.sent - self.progress.sent

    def check_start(self) -> None:
        """A client that had no token yet: its id's digest is of the prompt alone."""
        if self.left == 0 and self.progress.digest != self.target.digest:
            raise mismatch()

    def take(self, delta: Delta) -> Delta | None:
        """What of `delta` the client lacks (None: nothing yet); APIError if the re-run is not
        the request the client had."""
        n = self.left
        head, rest = delta.tokens[:n], delta.tokens[n:]
        self.detok.add(head)  # its text the client has
        self.progress.add(head)
        if self.left > 0:
            if delta.finished or self.detok.stopped:
                raise mismatch()
            return None
        if self.progress.digest != self.target.digest:
            raise mismatch()
        return Delta(rest, delta.finished, delta.finish_reason, delta.logprobs[len(head) :])


def mismatch() -> APIError:
    return APIError(
        "Last-Event-ID does not match this request (its body must be the one first sent)",
        409,
        "invalid_request_error",
        code="resume_mismatch",
    )
