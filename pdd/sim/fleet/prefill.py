"""A prefill instance: requests in arrival order, continuous batching with chunked prefill
(at most max_batched_tokens per step, shared first come first served, at most chunk_tokens of
one prompt), computing only the prompt tokens its prefix cache lacks. After each step the
chunk's KV exists (and streams out)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdd.sim.fleet.events import EventLoop
from pdd.sim.fleet.instance import Blocks, Instance
from pdd.sim.hardware.chip import Chip
from shared.engine.chunking import chunk_size

CacheEvents = Callable[[str, list[int], list[int]], None]  # (instance, stored, evicted)


@dataclass(eq=False, slots=True)
class PrefillWork:
    hashes: tuple[int, ...]
    input_tokens: int
    on_kv: Callable[[int], None]  # the KV of the prompt's first n tokens exists now
    on_done: Callable[[], None]  # the prompt is computed and the first token sampled
    computed: int = 0
    blocks: Blocks | None = None
    stepped: bool = False  # a step of it has ended (the engine has looked up its cached prefix)


class PrefillInstance(Instance):
    def __init__(
        self,
        name: str,
        chip: Chip,
        loop: EventLoop,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_batched_tokens: int,
        on_cache_events: CacheEvents,
        chunk_tokens: int = 0,
    ):
        super().__init__(name, chip, loop, num_blocks, block_size)
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.chunk_tokens = chunk_tokens or max_batched_tokens
        self.on_cache_events = on_cache_events
        self.active: list[PrefillWork] = []  # holding their blocks, in arrival order
        self.queued = 0  # submitted, waiting for blocks
        self.queued_tokens = 0  # ... their prompts' tokens
        self.on_backlog: Callable[[], None] | None = None  # told after each step and submission
        self._event: int | None = None
        self._chunks: list[tuple[PrefillWork, int]] = []
        self._started = 0.0

    def load_counts(self) -> tuple[int, int]:
        """(running, waiting) as the instance reports them."""
        return len(self.active), self.queued

    def pending_tokens(self) -> int:
        """Prompt tokens not computed yet, as the engine counts them (EngineStats.pending_tokens):
        a prompt whole until a step of it has ended, the running step's tokens included."""
        return self.queued_tokens + sum(
            w.input_tokens - w.computed if w.stepped else w.input_tokens for w in self.active
        )

    def submit(self, work: PrefillWork) -> None:
        self.queued += 1
        self.queued_tokens += work.input_tokens
        self.reserve(work.hashes, work.input_tokens, lambda blocks: self._admitted(work, blocks))
        if self.on_backlog is not None:
            self.on_backlog()

    def _admitted(self, work: PrefillWork, blocks: Blocks) -> None:
        self.queued -= 1
        self.queued_tokens -= work.input_tokens
        work.blocks = blocks
        # The last prompt token is always computed: its logits give the first token.
        work.computed = min(blocks.hits * self.block_size, work.input_tokens - 1)
        self.active.append(work)
        work.on_kv(work.computed)
        if self._event is None:
            self._event = self.loop.at(self.loop.now, self._step_end)

    def _step_end(self) -> None:
        self.busy_s += self.loop.now - self._started if self._chunks else 0.0
        if self.busy_spells is not None and self._chunks:
            self.busy_spells.append((self._started, self.loop.now))
        chunks, self._chunks = self._chunks, []
        for work, k in chunks:
            work.computed += k
            work.stepped = True
            self.register(work.blocks, work.hashes, work.computed // self.block_size)
        self._publish_cache_events()
        for work, _ in chunks:
            work.on_kv(work.computed)
            if work.computed >= work.input_tokens:
                self.active.remove(work)
                self.free(work.blocks)
                work.on_done()
        self._publish_cache_events()
        self._plan()
        if self.on_backlog is not None and chunks:
            self.on_backlog()

    def _plan(self) -> None:
        budget = self.max_batched_tokens
        for work in self.active[: self.max_num_seqs]:
            k = chunk_size(work.input_tokens - work.computed, budget, self.chunk_tokens)
            if k <= 0:
                break
            self._chunks.append((work, k))
            budget -= k
        if not self._chunks:
            self._event = None
            return
        step_s = self.chip.step.chunks_s([(k, w.computed) for w, k in self._chunks])
        self._started = self.loop.now
        self._event = self.loop.at(self.loop.now + step_s, self._step_end)

    def _publish_cache_events(self) -> None:
        stored, evicted = self.drain_events()
        if stored or evicted:
            self.on_cache_events(self.name, stored, evicted)
