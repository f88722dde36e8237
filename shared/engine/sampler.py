"""Sampling: greedy, temperature, min-p, top-k, top-p, with randomness keyed by position.

All sampled rows of a step draw at once, on the logits' device, by inverse transform: row r
takes the token whose interval of the filtered distribution's CDF holds u_r, one uniform per
row from a counter-based hash of (request seed, absolute position). So the same seeded
request draws the same tokens whichever instance runs each step and whatever else is in the
batch, and no vocabulary-sized noise is generated.
"""

from __future__ import annotations

import torch

from shared.engine.logits_processors import apply_min_p
from shared.engine.sampling_params import SamplingParams

_M64 = (1 << 64) - 1
NUCLEUS_CANDIDATES = 1024  # tokens top-p ranks first
_UNIFORM_BITS = 50  # (m + 0.5) / 2**50 is exact in a float64 and 2 ulps below 1 at the most


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    return _splitmix64(_splitmix64(seed & _M64) ^ position)


def uniform(seed: int, position: int) -> float:
    """The draw of one (request seed, position), in (0, 1), centred in its cell: u * total stays
    below total (the CDF's last value) after float64 rounding."""
    return ((mix_seed(seed, position) >> (64 - _UNIFORM_BITS)) + 0.5) / (1 << _UNIFORM_BITS)


def filtered_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows of fp32 logits / temperature, with the tokens min-p, top-k and top-p leave out at
    -inf (top-k keeps the tokens tied with the k-th). Each row's result depends on that row alone."""
    device, vocab = logits.device, logits.shape[-1]
    x = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    x = apply_min_p(x, [p.min_p for p in params])
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    nucleus = [p.top_p < 1.0 for p in params]
    if not (any(top_k) or any(nucleus)):
        return x
    # One partial sort serves both: every row's best max(top-k) tokens, and a few more where
    # top-p alone is asked for (the whole row is sorted only if a nucleus is wider).
    width = min(
        vocab, max(k or (NUCLEUS_CANDIDATES if n else 0) for k, n in zip(top_k, nucleus, strict=True))
    )
    ranked = torch.topk(x, width, dim=-1)
    if any(top_k):
        k = torch.tensor(top_k, device=device)
        kth = ranked.values.gather(1, (k - 1).clamp(min=0)[:, None])
        x = x.masked_fill((x < kth) & (k > 0)[:, None], float("-inf"))
    if any(nucleus):
        top_p = torch.tensor([p.top_p for p in params], device=device)
        within = _top_p(x, ranked.indices, top_p)
        x = within if within is not None else _top_p(x, torch.sort(x, dim=-1, descending=True).indices, top_p)
    return x  # type: ignore[return-value]


def _top_p(x: torch.Tensor, ranked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """x with the tokens past each row's nucleus at -inf, `ranked` [N, w] being each row's best w
    token ids, best first; None if some nucleus may reach past them."""
    sorted_x = x.gather(1, ranked)
    probs = torch.exp(sorted_x - torch.logsumexp(x, dim=-1, keepdim=True))  # the same whatever w is
    # Drop a token when the ones before it already reach top_p (the first always stays).
    drop = ((torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False  # a top_p below fp32's smallest number is 0 here, and would drop it too
    closed = drop[:, -1] | ((x > float("-inf")).sum(dim=-1) <= ranked.shape[-1]) | (top_p >= 1.0)
    if not bool(closed.all()):
        return None
    return x.scatter(1, ranked, sorted_x.masked_fill(drop, float("-inf")))


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> torch.Tensor:
    """Non-greedy rows [N, vocab] -> [N] token ids, one batched draw. The CDF is summed in
    float64; a token left out (probability 0) has an empty interval and is never drawn."""
    cdf = torch.cumsum(torch.softmax(filtered_logits(logits, params), dim=-1).double(), dim=-1)
    u = torch.tensor(
        [uniform(s, p) for s, p in zip(seeds, positions, strict=True)],
        dtype=torch.float64,
        device=logits.device,
    )
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
    ) -> list[int]:
        """logits [N, vocab] fp32; positions: absolute index each new token will have."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows and len(rows) == len(params):
            tokens = sample_rows(logits, params, seeds, positions)
        elif rows:
            pick = torch.tensor(rows, device=logits.device)
            at = [params[i] for i in rows], [seeds[i] for i in rows], [positions[i] for i in rows]
            tokens[pick] = sample_rows(logits[pick], *at)
        return tokens.tolist()
