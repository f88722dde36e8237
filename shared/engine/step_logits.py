"""One step's logits, made ready for the sampler: the prompt's logprobs collected from them, then
the grammar masks, min_tokens, logit_bias and the penalties (pure functions over sequences)."""

from __future__ import annotations

import torch

from shared.engine.grammar import apply_grammars
from shared.engine.logits_processors import process_row
from shared.engine.logprobs import logprobs_of
from shared.engine.scheduler import ScheduledSeq
from shared.engine.sequence import Sequence


def collect_prompt_logprobs(item: ScheduledSeq, rows: torch.Tensor) -> None:
    """Row i of this step's logits (position c + i) gives the logprobs of prompt token c + i + 1."""
    seq, c = item.seq, item.seq.num_computed_tokens
    m = min(item.num_new, seq.num_prompt_tokens - 1 - c)
    if m > 0 and seq.prompt_logprobs is not None:
        targets = seq.token_ids[c + 1 : c + 1 + m]
        seq.prompt_logprobs += logprobs_of(rows[:m], targets, seq.params.prompt_logprobs or 0)


def processed_logits(seqs: list[Sequence], logits: torch.Tensor, eos: tuple[int, ...]) -> torch.Tensor:
    """The logits the sampler draws from (logprobs stay those of the raw ones): the grammar's
    mask first (its state caught up with the tokens the sequence has), then min_tokens,
    logit_bias and the penalties."""
    constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
    rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
    if not rows and not constrained:
        return logits
    out = logits.clone()
    if constrained:
        states = [seqs[i].grammar for i in constrained]
        for i, state in zip(constrained, states, strict=True):
            state.catch_up(seqs[i].generated_token_ids())  # type: ignore[union-attr]
        apply_grammars(out, constrained, states)  # type: ignore[arg-type]
    for i in rows:
        s = seqs[i]
        masked = out[i].clone() if s.grammar is not None else None
        process_row(out[i], s.params, s.token_ids, s.num_prompt_tokens, eos)
        if masked is not None and not bool(torch.isfinite(out[i]).any()):
            out[i] = masked  # min_tokens held off the only token the grammar allows: it wins
    return out
