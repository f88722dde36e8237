"""A pdd request as the vLLM requests that compute it, and vLLM's outputs as pdd's StepOutputs:
pure (no vLLM import), so the translation is tested without vLLM.

Every vLLM request is over the pdd request's whole token list (prompt, then the output so far):
PREFILL and a HOLD batch's compute ask one output token (kept for PREFILL, dropped for HOLD),
GENERATE the rest of the output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from shared.engine.logprobs import TokenLogprobs
from shared.engine.outputs import FinishReason, StepOutput
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import Mode


@dataclass
class VllmRequest:
    rid: str
    tokens: list[int]  # prompt, then every output token so far (handed-over ones included)
    num_prompt: int
    params: SamplingParams
    mode: Mode
    hashes: list[int]  # the prompt's pdd block hashes
    running: str | None = None  # the vLLM request computing it now
    running_mode: Mode = Mode.GENERATE  # what that vLLM request is for
    sent: int = 0  # len(tokens) when that vLLM request was made
    counted: bool = False  # its prompt entered the stats
    prefilled: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.num_prompt


class Next(Enum):
    WAIT = auto()  # more outputs of the running vLLM request to come, or the caller's next move
    SUBMIT = auto()  # compute what came while it ran: a new vLLM request over every token
    FORGET = auto()  # the request ended


@dataclass(frozen=True)
class Logprobs:
    """What a vLLM output says of probabilities: per new token, and (first output only) per
    prompt token, vLLM's {token id: Logprob(logprob, rank)} (None where it has none)."""

    tokens: Sequence[Mapping[int, Any]] | None = None
    prompt: Sequence[Mapping[int, Any] | None] | None = None


def token_logprobs(entry: Mapping[int, Any], chosen: int, k: int) -> TokenLogprobs:
    """vLLM's logprobs of one position (the chosen token and the top k, each with its rank) as pdd's."""
    top = sorted(
        (lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k
    )
    mine = entry[chosen]
    return TokenLogprobs(mine.logprob, [t for _, t, _ in top], [lp for _, _, lp in top], mine.rank or 0)


def on_output(
    req: VllmRequest,
    tokens: list[int],
    finished: bool,
    reason: str | None,
    max_model_len: int,
    logprobs: Logprobs = Logprobs(),
) -> tuple[list[StepOutput], Next]:
    """One RequestOutput of the request's running vLLM request (tokens: the new ones; reason:
    vLLM's finish reason once finished) as pdd's outputs, and what the engine does next."""
    kind = req.running_mode
    lps = _token_lps(req, tokens, logprobs)
    if not finished:
        return (_tokens(req, tokens, None, lps) if kind is Mode.GENERATE else []), Next.WAIT
    req.running = None
    if reason in (None, "abort"):
        return [StepOutput(rid=req.rid, finished=True, finish_reason=FinishReason.ABORT)], Next.FORGET
    if kind is Mode.HOLD:  # a batch's KV is computed; the token vLLM sampled is not the relay's
        if len(req.tokens) > req.sent or req.mode is Mode.GENERATE:
            return [], Next.SUBMIT  # tokens (or the final extend) came while it ran: they join it
        return [StepOutput(rid=req.rid, computed=True)], Next.WAIT
    if kind is Mode.PREFILL:
        req.tokens.append(tokens[0])
        req.prefilled = True
        ends = first_token_ends(req, reason, max_model_len)
        out = StepOutput(
            rid=req.rid,
            token_id=tokens[0],
            index=0,
            finished=True,
            finish_reason=FinishReason.PREFILLED,
            ends=ends,
            logprobs=lps[0],
            prompt_logprobs=_prompt_lps(req, logprobs),
        )
        return [out], Next.WAIT  # its blocks stay until prefill releases it
    done = FinishReason.STOP if reason == "stop" else FinishReason.LENGTH
    return _tokens(req, tokens, done, lps), Next.FORGET


def _token_lps(req: VllmRequest, tokens: list[int], logprobs: Logprobs) -> list[TokenLogprobs | None]:
    k = req.params.logprobs
    if k is None or logprobs.tokens is None:
        return [None] * len(tokens)
    return [token_logprobs(entry, tok, k) for entry, tok in zip(logprobs.tokens, tokens, strict=True)]


def _prompt_lps(req: VllmRequest, logprobs: Logprobs) -> list[TokenLogprobs] | None:
    """Prompt tokens 1.. (vLLM gives the first None), when the request asked for them."""
    k = req.params.prompt_logprobs
    if k is None or logprobs.prompt is None:
        return None
    prompt = req.tokens[: req.num_prompt]
    return [token_logprobs(entry, tok, k) for entry, tok in zip(logprobs.prompt[1:], prompt[1:], strict=True)]


def _tokens(
    req: VllmRequest, tokens: list[int], done: FinishReason | None, lps: list[TokenLogprobs | None]
) -> list[StepOutput]:
    outs = []
    for k, tok in enumerate(tokens):
        req.tokens.append(tok)
        last = done is not None and k == len(tokens) - 1
        outs.append(
            StepOutput(
                rid=req.rid,
                token_id=tok,
                index=req.generated - 1,
                finished=last,
                finish_reason=done if last else None,
                logprobs=lps[k],
            )
        )
    if done is not None and not tokens:
        outs.append(StepOutput(rid=req.rid, finished=True, finish_reason=done))
    return outs


def first_token_ends(req: VllmRequest, reason: str | None, max_model_len: int) -> FinishReason | None:
    """Whether a PREFILL request ends at its first token (vLLM was asked for one token only)."""
    if reason == "stop":
        return FinishReason.STOP
    if req.params.max_tokens <= 1 or len(req.tokens) >= max_model_len:
        return FinishReason.LENGTH
    return None


def output_budget(req: VllmRequest, max_tokens: int, min_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(max_tokens, min_tokens) of the next vLLM request, given what the params leave."""
    max_tokens = min(max_tokens, max_model_len - len(req.tokens))
    if req.mode is not Mode.GENERATE:
        return 1, min(min_tokens, 1)
    return max_tokens, min_tokens
