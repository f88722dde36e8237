"""Seconds of one engine step, from what the step computes.

A step's cost is an overhead plus the larger of a compute term and a memory term, each
linear in the step's load (a roofline): a roofline profile derives both from a chip's peak
FLOP/s and memory bandwidth, a calibrated profile fits one of them to measured steps and
leaves the other at zero.

A run of pure decode steps (n sequences, each adding one token per step) grows the context
by n per step, so each term grows linearly with the step index: its total time is exact in
closed form, which lets the simulator jump over thousands of decode steps in one event.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepLoad:
    tokens: int  # tokens computed: prefill/extend chunk tokens + one per decoding sequence
    attn: int  # query-key pairs: over the computed tokens, the positions each attends to (itself included)
    kv_read: int  # KV tokens read: over the step's sequences, the context each already had
    seqs: int  # sequences in the step


def chunk_load(new_tokens: int, context: int) -> StepLoad:
    """One sequence computing `new_tokens` tokens after `context` cached ones (prefill or extend)."""
    return StepLoad(tokens=new_tokens, attn=chunk_attn(new_tokens, context), kv_read=context, seqs=1)


def chunk_attn(new_tokens: int, context: int) -> int:
    """A chunk's query-key pairs: each new token attends to the context and the new tokens up to itself."""
    return new_tokens * context + new_tokens * (new_tokens + 1) // 2


def decode_load(seqs: int, context_sum: int) -> StepLoad:
    """`seqs` sequences decoding one token each, their contexts summing to context_sum."""
    return StepLoad(tokens=seqs, attn=context_sum + seqs, kv_read=context_sum, seqs=seqs)


@dataclass(frozen=True)
class Linear:
    """const + Σ coefficient × load field (seconds)."""

    const: float = 0.0
    per_token: float = 0.0
    per_attn: float = 0.0
    per_kv_read: float = 0.0
    per_seq: float = 0.0

    def __call__(self, x: StepLoad) -> float:
        return self.of(x.tokens, x.attn, x.kv_read, x.seqs)

    def of(self, tokens: int, attn: int, kv_read: int, seqs: int) -> float:
        """self(StepLoad(tokens, attn, kv_read, seqs)), without making the load."""
        return (
            self.const
            + self.per_token * tokens
            + self.per_attn * attn
            + self.per_kv_read * kv_read
            + self.per_seq * seqs
        )

    def decode_line(self, seqs: int, context_sum: int) -> tuple[float, float]:
        """(a, b): this term for decode step i of a run is a + b·i."""
        a = self.of(seqs, context_sum + seqs, context_sum, seqs)  # (decode_load's fields)
        b = (self.per_attn + self.per_kv_read) * seqs
        return a, b


def _sum_line(a: float, b: float, i0: int, i1: int) -> float:
    """Σ_{i0 <= i < i1} (a + b·i)."""
    n = i1 - i0
    return n * a + b * n * (i0 + i1 - 1) / 2 if n > 0 else 0.0


def _surely_within(first: float, slope: float, budget_s: float) -> int:
    """Decode steps that fit within budget_s when the first takes `first` and each later one
    at most `slope` more than the one before: k·first + slope·k²/2 <= budget_s."""
    if slope <= 0:
        return int(budget_s / first)
    return int((math.sqrt(first * first + 2 * slope * budget_s) - first) / slope)


DecodeLines = tuple[float, float, float, float]  # (a, b) of the compute term, then of the memory term


@dataclass(frozen=True)
class StepCost:
    overhead_s: float
    compute: Linear
    memory: Linear

    def step_s(self, load: StepLoad) -> float:
        return self.step_s_of(load.tokens, load.attn, load.kv_read, load.seqs)

    def step_s_of(self, tokens: int, attn: int, kv_read: int, seqs: int) -> float:
        """step_s(StepLoad(tokens, attn, kv_read, seqs)), without making the load."""
        compute, memory = (
            self.compute.of(tokens, attn, kv_read, seqs),
            self.memory.of(tokens, attn, kv_read, seqs),
        )
        return self.overhead_s + (memory if memory > compute else compute)  # (max(), without the call)

    def chunks_s(
        self, chunks: Iterable[tuple[int, int]], decode_seqs: int = 0, decode_context: int = 0
    ) -> float:
        """step_s of one step computing `chunks` ((new tokens, context) each: chunk_load) beside
        `decode_seqs` decoding sequences whose contexts sum to decode_context (decode_load)."""
        tokens, attn, kv_read, seqs = decode_seqs, decode_context + decode_seqs, decode_context, decode_seqs
        for new, context in chunks:
            tokens += new
            attn += chunk_attn(new, context)
            kv_read += context
            seqs += 1
        return self.step_s_of(tokens, attn, kv_read, seqs)

    def decode_step_s(self, seqs: int, context_sum: int, i: int = 0) -> float:
        """Step i (from 0) of a decode run starting at context_sum."""
        context_sum += i * seqs
        return self.step_s_of(seqs, context_sum + seqs, context_sum, seqs)  # (decode_load's fields)

    def decode_lines(self, seqs: int, context_sum: int) -> DecodeLines:
        """The compute and memory terms of a decode run's steps as lines (decode_line of each)."""
        return (*self.compute.decode_line(seqs, context_sum), *self.memory.decode_line(seqs, context_sum))

    def decode_run_s(self, seqs: int, context_sum: int, steps: int) -> float:
        """Exact seconds of `steps` decode steps of `seqs` sequences starting at context_sum."""
        if steps <= 0 or seqs <= 0:
            return 0.0
        return self.run_s(self.decode_lines(seqs, context_sum), steps)

    def run_s(self, lines: DecodeLines, steps: int) -> float:
        """decode_run_s of a run whose decode_lines are `lines` (steps > 0)."""
        ac, bc, am, bm = lines
        # compute - memory = (ac - am) + (bc - bm)·i changes sign at most once: split there.
        da, db = ac - am, bc - bm
        if db == 0:
            cut, first_is_compute = (0 if da < 0 else steps), True  # compute wins on [0, cut)
        else:  # the first branch wins for i below the crossing index -da/db
            cut, first_is_compute = min(max(math.ceil(-da / db), 0), steps), db < 0
        first, second = ((ac, bc), (am, bm)) if first_is_compute else ((am, bm), (ac, bc))
        return steps * self.overhead_s + _sum_line(*first, 0, cut) + _sum_line(*second, cut, steps)

    def decode_steps_within(self, seqs: int, context_sum: int, budget_s: float) -> int:
        """The most decode steps whose run ends within budget_s."""
        if seqs <= 0 or budget_s <= 0:
            return 0
        first = self.decode_step_s(seqs, context_sum)
        if first <= 0:
            raise ValueError("a decode step must take time")
        lines, run_s = self.decode_lines(seqs, context_sum), self.run_s
        hi = int(budget_s / first) + 1  # steps never get cheaper, so no more than this
        lo = min(_surely_within(first, max(lines[1], lines[3]), budget_s), hi)
        lo = lo if lo > 0 and run_s(lines, lo) <= budget_s else 0  # (checked: the bound is in real numbers)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if run_s(lines, mid) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
