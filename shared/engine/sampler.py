"""Sampling: greedy, temperature, top-k, top-p, with randomness keyed by position.

The noise for a sampled row comes from a fresh generator seeded with mix(request seed,
absolute position): the same seeded request draws the same tokens whichever instance
runs each step (exponential race: argmax p_i / E_i with E_i ~ Exp(1) samples i ~ p).
"""

from __future__ import annotations

import torch

from shared.engine.sampling_params import SamplingParams

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    return _splitmix64(_splitmix64(seed & _M64) ^ position) & ((1 << 63) - 1)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of fp32 logits -> probabilities after temperature, top-k and top-p."""
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the ones before it already reach top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One non-greedy row (greedy rows are the batch argmax in Sampler)."""
    probs = filtered_probs(logits, params).cpu()
    gen = torch.Generator().manual_seed(mix_seed(seed, position))
    noise = torch.empty(probs.numel(), dtype=torch.float32).exponential_(generator=gen)
    return int((probs / noise).argmax())


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
        """logits [N, vocab] fp32; positions: absolute index each new token will have."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = sample_row(logits[i], p, seeds[i], positions[i])
        return tokens
