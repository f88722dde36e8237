"""Log-probabilities of chosen tokens and their top alternatives.

Computed in fp32 with log_softmax over the raw logits of the step that produced the token,
before temperature, top-k and top-p (the model's own distribution, as vLLM returns by
default), so they do not depend on how the token was drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # most alternatives a request may ask for (OpenAI's limit)


@dataclass
class TokenLogprobs:
    """One position: the chosen token's logprob and the top-k (ids, logprobs), best first."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int = 0  # of the chosen token: 1 + how many tokens are more likely (0: not computed)


def logprobs_of(logits: torch.Tensor, token_ids: list[int], top_k: int) -> list[TokenLogprobs]:
    """logits [N, vocab] (row i produced token_ids[i]) -> one TokenLogprobs per row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = lp.gather(1, torch.tensor(token_ids, device=lp.device).view(-1, 1))
    ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t.view(-1).tolist()
    if top_k > 0:
        top = torch.topk(lp, min(top_k, lp.shape[-1]), dim=-1)
        ids, vals = top.indices.tolist(), top.values.tolist()
    else:
        ids = vals = [[] for _ in token_ids]
    return [TokenLogprobs(c, i, v, r) for c, i, v, r in zip(chosen, ids, vals, ranks, strict=True)]


def sampled_logprobs(
    logits: torch.Tensor, tokens: list[int], top_ks: list[int | None]
) -> list[TokenLogprobs | None]:
    """Per row of a sampling step: logprobs for the rows whose request asked (top_k not None)."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(top_ks) if k is not None]
    for k in sorted({top_ks[i] for i in rows}):  # type: ignore[type-var]
        same = [i for i in rows if top_ks[i] == k]
        for i, lp in zip(same, logprobs_of(logits[same], [tokens[i] for i in same], k), strict=True):
            out[i] = lp
    return out
