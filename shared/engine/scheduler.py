"""Continuous batching: running sequences first (decodes, then prefill chunks and extends),
then new prefills admitted by free blocks, all within max_batched_tokens per step.

When a running sequence needs a block and none is free, the youngest running sequence is
preempted: its blocks are released (full ones stay in the prefix cache) and it goes back
to the queue, ahead of every newer request, to be recomputed later. The oldest always makes progress, and
add_request already refused anything that cannot fit in the whole pool, so the loop never
deadlocks on its own; it can only wait for blocks held by HOLD/PREFILL sequences or pins.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.config import EngineSettings
from shared.engine.block_pool import BlockPool, blocks_for
from shared.engine.chunking import chunk_size
from shared.engine.hashing import extend_block_hashes
from shared.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens of this sequence computed in this step, from seq.num_computed_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, settings: EngineSettings, model_id: str) -> None:
        self.pool = pool
        self.block_size = settings.block_size
        self.max_num_seqs = settings.max_num_seqs
        self.max_batched_tokens = settings.max_batched_tokens
        self.chunk_tokens = settings.chunk_tokens or settings.max_batched_tokens
        self.model_id = model_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_hit_tokens = 0  # tokens admitted from the prefix cache, since start
        self.num_queried_tokens = 0  # tokens of the sequences admitted (looked up in the cache), since start
        self.num_computed_tokens = 0  # tokens run through the model, since start

    def pending_tokens(self) -> int:
        """Tokens not yet run through the model, of every waiting and running sequence."""
        return sum(s.num_uncomputed for s in self.waiting) + sum(s.num_uncomputed for s in self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def resume(self, seq: Sequence) -> None:
        """A held sequence got new tokens: it runs again with the blocks it has."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def hold(self, seq: Sequence) -> None:
        """A HOLD sequence has all its KV: it keeps its blocks and waits for extend()."""
        self.running.remove(seq)
        seq.status = SeqStatus.HELD

    def park_prefilled(self, seq: Sequence) -> None:
        """A PREFILL sequence sampled its token: it keeps its blocks until released."""
        self.running.remove(seq)
        seq.status = SeqStatus.PREFILLED

    def commit(self, item: ScheduledSeq) -> None:
        """The forward computed item's tokens: count them and put the blocks they filled
        in the prefix cache (so every full computed block is registered)."""
        seq, bs = item.seq, self.block_size
        registered = seq.num_computed_tokens // bs
        seq.num_computed_tokens += item.num_new
        self.num_computed_tokens += item.num_new
        full = seq.num_computed_tokens // bs
        if full == registered:
            return
        extend_block_hashes(seq.hashes, seq.token_ids, bs, self.model_id)
        for i in range(registered, full):
            # A twin already cached is shared instead, so the hash stays cached (and
            # exportable) as long as this sequence lives.
            seq.block_table[i] = self.pool.register_or_share(seq.block_table[i], seq.hashes[i])

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_batched_tokens
        out: list[ScheduledSeq] = []
        done: set[int] = set()  # ids of sequences scheduled in this step
        preempted = False
        # Decodes first, so a long prefill chunk never stalls token streams; then by age.
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed > 1, s.arrival)):
            if budget == 0 or len(out) >= self.max_num_seqs:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = chunk_size(seq.num_uncomputed, budget, self.chunk_tokens)
            need = blocks_for(seq.num_computed_tokens + n, self.block_size) - len(seq.block_table)
            while need > self.pool.num_free:
                # The youngest sequence not yet scheduled in this step (possibly seq itself).
                victim = max((s for s in self.running if id(s) not in done), key=lambda s: s.arrival)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.block_table += [self.pool.allocate() for _ in range(need)]
            out.append(ScheduledSeq(seq, n))
            done.add(id(seq))
            budget -= n
        # New work only when nothing had to be preempted (it would be thrown out next step).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            self.waiting.popleft()
            out.append(item)
            budget -= item.num_new
        return out

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        bs = self.block_size
        extend_block_hashes(seq.hashes, seq.token_ids, bs, self.model_id)
        # Reuse the longest cached run of full blocks, but always compute >= 1 token:
        # the last token's logits are needed (to sample, or to keep for a held sequence).
        hit = self.pool.lookup(seq.hashes)[: (seq.num_tokens - 1) // bs]
        if seq.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: the prefix cache
            # keeps KV, not logits, so this request computes its whole prompt.
            hit, seq.prompt_logprobs = [], []
        num_cached = len(hit) * bs
        n = chunk_size(seq.num_tokens - num_cached, budget, self.chunk_tokens)
        new = blocks_for(num_cached + n, bs) - len(hit)
        reserve = len(self.running)  # roughly one block per running sequence for its next step
        if new + self.pool.cost_of(hit) + reserve > self.pool.num_free:
            return None
        for bid in hit:
            self.pool.touch(bid)
        seq.block_table = hit + [self.pool.allocate() for _ in range(new)]
        seq.num_computed_tokens = num_cached
        self.num_hit_tokens += num_cached
        self.num_queried_tokens += seq.num_tokens
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return ScheduledSeq(seq, n)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.status = SeqStatus.WAITING
        seq.last_logits = None
        # Back to the queue, ahead of newer requests, behind older preempted ones.
        pos = 0
        while pos < len(self.waiting) and self.waiting[pos].arrival < seq.arrival:
            pos += 1
        self.waiting.insert(pos, seq)
        self.num_preemptions += 1

    def free_blocks(self, seq: Sequence) -> None:
        # Tail first: the tail is evicted before the prefix, which other requests share.
        for bid in reversed(seq.block_table):
            self.pool.release(bid)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from the queues and free its blocks (finish, abort, release)."""
        if seq.status is SeqStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.free_blocks(seq)
        seq.status = SeqStatus.DONE
