"""Logits processing before the sampler, in vLLM's order and with its formulas.

1. min_tokens: while a request has fewer output tokens than min_tokens, its EOS and stop token
   ids are at -inf (whatever ignore_eos says: the EOS is never drawn early).
2. logit_bias: each token's bias is added to its logit.
3. penalties, from the whole token history (so any instance continuing a request processes
   its logits as the one engine that ran it all would):
   - repetition_penalty over the prompt and the output: a positive logit is divided by it, a
     negative one multiplied;
   - frequency_penalty x the token's count in the output, subtracted;
   - presence_penalty, subtracted once from every token the output holds.
Greedy requests take the argmax of the result. min_p is the sampler's (after temperature).
Each row's result depends on that row's own logits and history alone.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from shared.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def suppress_stops(
    row: torch.Tensor, params: SamplingParams, num_generated: int, eos: Collection[int]
) -> None:
    """min_tokens, in place on one row [vocab]."""
    if num_generated < params.min_tokens:
        ids = [t for t in {*eos, *params.stop_token_ids} if 0 <= t < row.shape[-1]]
        if ids:
            row[ids] = NEG_INF


def add_bias(row: torch.Tensor, params: SamplingParams) -> None:
    """logit_bias, in place on one row [vocab]."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        row.index_add_(
            0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)
        )


def penalize(row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
    """Repetition, frequency and presence penalties, in place on one row [vocab]."""
    vocab, device = row.shape[-1], row.device
    out = torch.tensor(output, dtype=torch.long, device=device)
    counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        r = params.repetition_penalty
        row.copy_(torch.where(seen, torch.where(row > 0, row / r, row * r), row))
    if params.frequency_penalty:
        row.sub_(params.frequency_penalty * counts)
    if params.presence_penalty:
        row.sub_(params.presence_penalty * (counts > 0).to(row.dtype))


def process_row(
    row: torch.Tensor,
    params: SamplingParams,
    token_ids: list[int],
    num_prompt_tokens: int,
    eos: Collection[int],
) -> None:
    """Everything before the sampler for one request, in place; token_ids: its whole history."""
    output = token_ids[num_prompt_tokens:]
    suppress_stops(row, params, len(output), eos)
    add_bias(row, params)
    if params.penalized:
        penalize(row, params, token_ids[:num_prompt_tokens], output)


def apply_min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Rows [N, vocab] of temperature-scaled logits with the tokens whose probability is below
    min_p x the row's largest at -inf (rows with min_p 0 unchanged)."""
    if not any(min_p):
        return x
    probs = torch.softmax(x, dim=-1)
    floor = (
        torch.tensor(min_p, device=x.device, dtype=probs.dtype)[:, None]
        * probs.max(dim=-1, keepdim=True).values
    )
    return x.masked_fill(probs < floor, NEG_INF)
