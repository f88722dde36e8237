"""A decoding instance (D, MD or RLD): continuous batching of running sequences, one token
each per step, with handoff extend passes batched into steps.

No event per token: while the batch does not change, the instance advances in one event
over a whole run of decode steps (StepCost.decode_run_s), and each sequence learns its
token times in closed form: the run's first and last token times and its largest gap (step
times grow within a run, so the largest is its last). Steps are not interruptible: a change
(a sequence joining, an extend, a relay's snapshot) waits for the step in progress to end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.give_way import GiveWay
from pdd.sim.fleet.instance import Instance
from pdd.sim.hardware.chip import Chip

TokenSink = Callable[
    [float, float, int, float], None
]  # (first time, last time, tokens, largest gap between them)


@dataclass(eq=False, slots=True)
class Seq:
    context: int  # tokens whose KV this instance holds
    remaining: int  # tokens still to produce here
    on_tokens: TokenSink
    on_finished: Callable[[], None]  # it produced its last token (called at that step's end)
    produced: int = 0
    on_start: Callable[[float], None] | None = None  # it took a slot in the batch (at this time)


@dataclass(eq=False, slots=True)
class Extend:
    """Handoff token IDs for MD to compute into a held sequence's KV."""

    seq: Seq
    tokens: int  # left to compute
    final: bool  # the last batch: sample the next token after it, then decode on
    on_done: Callable[[], None]


class DecodeInstance(Instance):
    def __init__(
        self,
        name: str,
        chip: Chip,
        loop: EventLoop,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
    ):
        super().__init__(name, chip, loop, num_blocks, block_size)
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.running: list[Seq] = []
        self.joining: deque[Seq] = deque()
        self.extending: deque[Extend] = deque()
        self.actions: list[Callable[[], None]] = []  # to run at the next step boundary
        self._event: int | None = None  # the current run's end
        self._t0 = 0.0
        self._steps = 0  # decode steps of the current run (0: a mixed step)
        self._context0 = 0  # the running sequences' context sum at the run's start
        self._chunks: list[tuple[Extend, int]] = []  # the mixed step's extend work
        self._in_boundary = False
        self.give_way: GiveWay | None = None  # on a host shared with prefill (give_way.py)
        self._giving_way = False  # no step until the current event (give_way.py)

    # ---- what others ask -----------------------------------------------------------------
    def join(self, seq: Seq) -> None:
        self.joining.append(seq)
        self.load_changed = True
        self._poke()

    def extend(self, ext: Extend) -> None:
        self.extending.append(ext)
        self.load_changed = True
        self._poke()

    def join_imported(self, seq: Seq) -> None:
        """A sequence whose KV has just arrived. The engine runs commands between steps on its
        one thread (shared/serving/engine_loop.py): the import runs when the step in progress
        ends, and the add is a second command, so on a busy decoder it waits for the step that
        began meanwhile."""

        def imported() -> None:
            if self.running or self.joining or self.extending:
                self.at_boundary(lambda: self.join(seq))
            else:
                self.join(seq)

        self.at_boundary(imported)

    def at_boundary(self, fn: Callable[[], None]) -> None:
        """Run fn once the step in progress ends (at once if idle or giving way), the batch settled."""
        if self._giving_way:
            fn()
            return
        self.actions.append(fn)
        self._poke()

    def backlog_changed(self) -> None:
        """Prefill's backlog moved: a decoder giving way looks again now; one decoding stops at
        its next step boundary if it may have to give way."""
        if self._giving_way:
            self.loop.cancel(self._event)
            self._event = self.loop.at(self.loop.now, self._boundary)
        elif self._steps > 1 and self.give_way.may_wait(self.loop.now):
            self._cut()

    def remove(self, seq: Seq) -> None:
        """Stop a sequence (only from an at_boundary action)."""
        self.load_changed = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.joining:
            self.joining.remove(seq)

    @property
    def busy(self) -> int:
        return len(self.running) + len(self.extending)

    @property
    def waiting(self) -> int:
        return len(self.joining) + len(self.block_waiters)

    def load_counts(self) -> tuple[int, int]:
        """(running, waiting) as the instance reports them."""
        return len(self.running) + len(self.extending), len(self.joining) + len(self.block_waiters)

    # ---- the step loop ---------------------------------------------------------------------
    def _poke(self) -> None:
        """Something changed: end the current run at the next step boundary (or start now)."""
        if self._in_boundary:
            return
        if self._event is None:
            self._event = self.loop.at(self.loop.now, self._boundary)
        elif self._steps > 1:
            self._cut()

    def _cut(self) -> None:
        step, n = self.chip.step, len(self.running)
        elapsed = self.loop.now - self._t0
        done = step.decode_steps_within(n, self._context0, elapsed)
        lines = step.decode_lines(n, self._context0)  # (decode_run_s of the run, part by part)
        cut = done if done >= 1 and step.run_s(lines, done) == elapsed else done + 1
        if cut < self._steps:
            self.loop.cancel(self._event)
            self._steps = cut
            self._event = self.loop.at(self._t0 + step.run_s(lines, cut), self._boundary)

    def _boundary(self) -> None:
        self._event, self._giving_way = None, False
        self._in_boundary = True
        self._settle()
        for seq in [s for s in self.running if s.remaining <= 0]:
            self.running.remove(seq)
            seq.on_finished()
        actions, self.actions = self.actions, []
        for fn in actions:
            fn()
        while self.joining and len(self.running) < self.max_num_seqs:
            seq = self.joining.popleft()
            self.running.append(seq)
            if seq.on_start is not None:
                seq.on_start(self.loop.now)
        self.load_changed = True
        self._in_boundary = False
        self._plan()

    def _plan(self) -> None:
        self._t0 = self.loop.now
        if self.give_way and (self.running or self.extending):
            until = self.give_way.wait_until(self.loop.now)
            if until is not None:  # no step before then (unless the backlog moves first)
                self._steps, self._giving_way = 0, True
                self._event = self.loop.at(until, self._boundary)
                return
        self._context0 = sum(map(_context, self.running))
        if self.extending:
            self._steps, self._chunks = 0, self._extend_chunks()
            step_s = self.chip.step.chunks_s(
                [(k, e.seq.context) for e, k in self._chunks], len(self.running), self._context0
            )
            self._event = self.loop.at(self._t0 + step_s, self._boundary)
        elif self.running:  # (an action queued at this boundary waits for the next one only)
            self._steps = 1 if self.actions else min(map(_remaining, self.running))
            run_s = self.chip.step.decode_run_s(len(self.running), self._context0, self._steps)
            self._event = self.loop.at(self._t0 + run_s, self._boundary)

    def _extend_chunks(self) -> list[tuple[Extend, int]]:
        """The extend work of one step, first come first served, within the token budget."""
        budget = self.max_batched_tokens - len(self.running)
        chunks = []
        for ext in self.extending:
            k = min(ext.tokens, max(budget, 0 if chunks else 1))
            if k <= 0:
                break
            chunks.append((ext, k))
            budget -= k
        return chunks

    def _settle(self) -> None:
        """Account for the run (or mixed step) that ends now."""
        if self._steps == 0 and not self._chunks:
            return  # idle until now
        self.busy_s += self.loop.now - self._t0
        if self.busy_spells is not None:
            self.busy_spells.append((self._t0, self.loop.now))
        if self._steps:
            self._settle_decode()
        else:
            self._settle_mixed()

    def _settle_decode(self) -> None:
        step, n, steps = self.chip.step, len(self.running), self._steps
        first = self._t0 + step.decode_step_s(n, self._context0, 0)
        gap = step.decode_step_s(n, self._context0, steps - 1) if steps >= 2 else 0.0
        now = self.loop.now
        for seq in self.running:
            seq.context += steps
            seq.produced += steps
            seq.remaining -= steps
            seq.on_tokens(first, now, steps, gap)
        self._steps = 0

    def _settle_mixed(self) -> None:
        now = self.loop.now
        for seq in self.running:
            seq.context += 1
            _one_token(seq, now)
        chunks, self._chunks = self._chunks, []
        for ext, k in chunks:
            ext.tokens -= k
            ext.seq.context += k
            if ext.tokens > 0:
                continue
            self.extending.remove(ext)
            if not ext.final:
                ext.on_done()
                continue
            _one_token(ext.seq, now)  # the extend pass's logits give the next token
            ext.on_done()
            if ext.seq.remaining > 0:
                self.running.append(ext.seq)
            else:
                ext.seq.on_finished()


_context, _remaining = (
    attrgetter("context"),
    attrgetter("remaining"),
)  # (over a batch without a Python step each)


def _one_token(seq: Seq, now: float) -> None:
    seq.produced += 1
    seq.remaining -= 1
    seq.on_tokens(now, now, 1, 0.0)
