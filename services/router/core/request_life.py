"""The router's request life as a pure state machine: an event goes in (a request routed, its
dispatch answered, a token message, a heartbeat, a clock tick, a move's outcome, the client
leaving); the requests' new state and the actions it calls for come out. No NATS and no
asyncio here: the adapter (services/router/adapter) subscribes, feeds the events in and
performs the actions, as an engine's runner performs what its scheduler planned.

Token merging happens here, on arrival: each output index reaches the client exactly once
and in order, whichever instance (relay or MD, old attempt or new) sent it."""

from __future__ import annotations

from shared.bus import subjects
from shared.bus.messages import (
    AbortReason,
    LoadReport,
    MainDecodeLost,
    MainDecodeTarget,
    Outcome,
    Role,
    TokenEvent,
)
from shared.bus.subjects import Req
from shared.config import RouterSettings

from .actions import (
    Action,
    Closed,
    CountReports,
    Deliver,
    Forget,
    Move,
    Publish,
    Resume,
    SendAbort,
    UnknownMessage,
)
from .request_stream import ENDED, MOVABLE, Delta, Failure, RequestStream, StreamState

STALE_ABORT_EVERY_S = 10.0  # an abandoned attempt that keeps producing is told again after this
STRAY_GRACE_S = 0.5  # an ended attempt still listed by an instance after this is told again


class RequestLife:
    def __init__(self, settings: RouterSettings, rid_prefix: str) -> None:
        self.settings = settings
        self.rid_prefix = rid_prefix  # this router's request ids start with it
        self.streams: dict[str, RequestStream] = {}  # by the client's request id
        self.attempts: dict[str, RequestStream] = {}  # by the backends' id of the current attempt
        self.stale_aborted: dict[str, float] = {}  # attempt ids told to stop recently (rate limit)
        self.strays: dict[str, float] = {}  # ended attempts an instance still lists: since when

    # ---- a request is routed and dispatched -----------------------------------------
    def opened(self, stream: RequestStream) -> None:
        self.streams[stream.rid] = self.attempts[stream.rid] = stream

    def dispatched(self, stream: RequestStream, prefill: str, target: MainDecodeTarget) -> list[Action]:
        """P took the request and MD said which blocks it lacks: P learns where to send them."""
        if not stream.state.is_in(StreamState.DISPATCHING):
            return []  # an instance failed it meanwhile and it moved (or ended)
        stream.dispatched(prefill)
        if stream.merger.finished:  # prefill's tokens were all it took (e.g. max_tokens 1)
            stream.finish()
        return [Publish(subjects.to_instance(Role.PREFILL, prefill, Req.MD_TARGET), target)]

    def refused(self, stream: RequestStream, why: str) -> list[Action]:
        """P or MD refused the request itself: it ends here."""
        stream.fail(why)
        return self.abort(stream.rid, AbortReason.DISPATCH_FAILED)

    # ---- inbound messages -------------------------------------------------------------
    def on_tokens(self, ev: TokenEvent, now: float) -> list[Action]:
        stream = self.attempts.get(ev.rid)
        if stream is None:
            return self._unknown(ev, now)
        if ev.outcome is Outcome.ERROR and stream.state.is_in(StreamState.DISPATCHING, *MOVABLE):
            # The instance failed the request (a lost peer, a cut transfer): continue elsewhere.
            return [Move(stream, f"{ev.source.value} failed it: {ev.error}", "error")]
        actions: list[Action] = []
        relay = ev.relay if ev.relay is not None and ev.relay != stream.relay else None
        decode = ev.decode if ev.decode is not None and ev.decode != stream.decode else None
        if relay or decode:
            actions.append(CountReports(relay, decode))
        stream.observe(ev)
        if stream.state.is_in(*ENDED):
            return actions  # a late copy: the client has all it gets
        if ev.outcome is Outcome.ERROR:  # failed while it could not move (e.g. while moving)
            return actions + [Deliver(stream, Failure(f"request failed on {ev.source.value}: {ev.error}"))]
        return actions + self._merge(stream, ev, now)

    def _merge(self, stream: RequestStream, ev: TokenEvent, now: float) -> list[Action]:
        if stream.merger.finished:
            return []  # finished while dispatching: the client has had the finish once
        merged = stream.merger.add(
            ev.index, ev.tokens, ev.finished, ev.outcome.value if ev.outcome else None, ev.logprobs
        )
        if ev.prompt_logprobs is not None and stream.prompt_logprobs is None:
            stream.prompt_logprobs = ev.prompt_logprobs
        ttft = gap = None
        if merged.tokens and stream.first_token_at is None:
            stream.first_token_at = now
            ttft = now - stream.created
        elif merged.tokens and stream.merged_at is not None:
            gap = now - stream.merged_at
        if merged.tokens:
            stream.merged_at = now
        if merged.finished and not stream.state.is_in(StreamState.DISPATCHING):
            stream.finish()  # (while dispatching: once dispatched, see there)
        if not (merged.tokens or merged.finished):
            return []
        reason = stream.merger.finish_reason if merged.finished else None
        return [Deliver(stream, Delta(merged.tokens, merged.finished, reason, merged.logprobs), ttft, gap)]

    def _unknown(self, ev: TokenEvent, now: float) -> list[Action]:
        if not ev.rid.startswith(self.rid_prefix):
            return []  # another router's request
        actions: list[Action] = [UnknownMessage(ev.rid)]
        if not ev.finished and ev.rid not in self.stale_aborted:
            # An abandoned attempt (its abort was lost?) still producing: tell it again, not on every token.
            self.stale_aborted[ev.rid] = now
            actions.append(SendAbort(ev.rid, AbortReason.STALE))
        return actions

    def bound_for_relays(self) -> dict[str, list[str]]:
        """Per relay: the attempt ids of this router's requests routed to it that it has not
        handed over yet (P→RLD→MD, dispatching or relayed)."""
        out: dict[str, list[str]] = {}
        for stream in self.streams.values():
            if stream.relay_instance and stream.state.is_in(StreamState.DISPATCHING, StreamState.RELAYED):
                out.setdefault(stream.relay_instance, []).append(stream.attempt_rid)
        return out

    def on_held(self, report: LoadReport, now: float) -> list[Action]:
        """A heartbeat: the instance still holds the requests it lists. One of this router's
        attempts that it lists though the router no longer follows it lost its abort (NATS
        delivers at most once): it is told again, or it would hold its blocks while this
        router lives."""
        me = (report.service, report.instance)
        actions: list[Action] = []
        for rid in report.held:
            stream = self.attempts.get(rid)
            if stream is not None:
                if stream.producer == me:
                    stream.last_held = now
            elif rid.startswith(self.rid_prefix) and rid not in self.stale_aborted:
                # (A heartbeat sent just before the abort arrived lists it too: one more first.)
                if now - self.strays.setdefault(rid, now) >= STRAY_GRACE_S:
                    del self.strays[rid]
                    self.stale_aborted[rid] = now
                    actions.append(SendAbort(rid, AbortReason.STALE))
        return actions

    # ---- the clock ----------------------------------------------------------------------
    def tick(
        self, now: float, alive_md: set[str], alive_prefill: dict[str, str] | None = None
    ) -> list[Action]:
        """Act on lost instances: an MD lost before the handoff leaves the relay to finish;
        a request whose producer is lost, whose token went missing or that stalled moves, and
        so does one whose MD waits for a lost prefill (`alive_prefill`: instance -> its process
        epoch, a restarted one holds nothing; None: not known)."""
        s = self.settings
        actions: list[Action] = []
        for stream in list(self.streams.values()):
            if stream.state.is_in(StreamState.RELAYED) and stream.md_instance not in alive_md:
                stream.md_lost()  # before the handoff the relay finishes it: no move needed
                lost = MainDecodeLost(stream.attempt_rid, stream.md_instance)
                for role, inst in (
                    (Role.PREFILL, stream.prefill_instance),
                    (Role.RELAY, stream.relay_instance),
                ):
                    if inst:  # P stops the WAN stream, the relay finishes the request
                        actions.append(Publish(subjects.to_instance(role, inst, Req.MD_LOST), lost))
            prefill_lost = alive_prefill is not None and _lost(stream, alive_prefill)
            stall = stream.stall(
                now,
                s.lost_after_s,
                s.gap_timeout_s,
                s.stall_timeout_s,
                prefill_lost,
                s.streaming_lost_after_s,
            )
            if stall is not None:
                actions.append(Move(stream, *stall))
        for rid in [r for r, t in self.stale_aborted.items() if now - t > STALE_ABORT_EVERY_S]:
            del self.stale_aborted[rid]
        for rid in [r for r, t in self.strays.items() if now - t > STALE_ABORT_EVERY_S]:
            del self.strays[rid]  # no longer listed
        return actions

    # ---- migration by token IDs ---------------------------------------------------------
    def move(self, stream: RequestStream, why: str, cause: str) -> list[Action]:
        """Start a move: a new attempt continues from the tokens the client has; the old one
        is aborted, its late messages no longer reach the stream. [] if the request ended or
        another move is under way."""
        if not stream.state.is_in(StreamState.DISPATCHING, *MOVABLE):
            return []
        if stream.attempt >= self.settings.migration_limit:
            return self.give_up(stream, f"{why}; migration limit ({self.settings.migration_limit}) reached")
        old = stream.attempt_rid
        self.attempts.pop(old, None)
        self.attempts[stream.migrating()] = stream
        return [SendAbort(old, AbortReason.MIGRATED, stream), Resume(stream, why, cause)]

    def recomputing(self) -> dict[tuple[Role, str], int]:
        """Per instance: the tokens the moved requests recomputing there (RequestStream.recomputing_on)
        have it compute before their next token."""
        out: dict[tuple[Role, str], int] = {}
        for stream in self.streams.values():
            if stream.attempt and (where := stream.recomputing_on) is not None:
                out[where] = out.get(where, 0) + stream.recompute_tokens
        return out

    def resumed(self, stream: RequestStream, role: Role, instance: str) -> None:
        if not stream.state.is_in(*ENDED):  # (its new instance may have finished it already)
            stream.resumed(role, instance)

    def give_up(self, stream: RequestStream, why: str) -> list[Action]:
        """No instance takes the request: it fails, and its consumer hears why."""
        stream.fail(why)
        return [Deliver(stream, Failure(stream.failure or "request failed"))]

    # ---- the end --------------------------------------------------------------------------
    def close(self, stream: RequestStream) -> list[Action]:
        """The stream ended (finished, failed or abandoned): free it everywhere. Also after a
        normal finish whatever still holds the request (e.g. an MD whose transfer the relay
        made moot) is told, so it frees it now rather than at its timeout."""
        self.streams.pop(stream.rid, None)
        self.attempts.pop(stream.attempt_rid, None)
        stream.fail("client went away")  # no-op unless it is still running
        reason = AbortReason.FINISHED if stream.done else AbortReason.CLIENT_GONE
        return [Closed(stream), SendAbort(stream.attempt_rid, reason, stream)]

    def release(self, stream: RequestStream) -> list[Action]:
        """Close a stream whose consumer never ran to its end; nothing once it is closed."""
        return self.close(stream) if self.streams.get(stream.rid) is stream else []

    def abort(self, rid: str, reason: AbortReason) -> list[Action]:
        """Give up on the client's request `rid`: every instance drops its current attempt."""
        stream = self.streams.pop(rid, None)
        if stream is None:
            return [SendAbort(rid, reason)]
        stream.fail(reason.value)
        self.attempts.pop(stream.attempt_rid, None)
        return [Forget(rid), SendAbort(stream.attempt_rid, reason)]


def _lost(stream: RequestStream, alive_prefill: dict[str, str]) -> bool:
    """The stream's prefill is gone: not alive, or alive again as another process."""
    epoch = alive_prefill.get(stream.prefill_instance or "")
    return epoch is None or bool(stream.prefill_epoch and epoch != stream.prefill_epoch)
