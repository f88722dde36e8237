"""Sequence: one request's tokens, blocks and progress. Plain data; the scheduler moves it."""

from __future__ import annotations

from enum import Enum, StrEnum, auto

import torch

from shared.engine.grammar import GrammarState
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling_params import SamplingParams


class Mode(StrEnum):
    """What the caller wants from a request."""

    GENERATE = "generate"  # decode until a stop condition
    PREFILL = "prefill"  # compute the prompt, sample one token, keep the blocks until release()
    HOLD = "hold"  # compute the tokens, keep the logits; extend() adds tokens, final=True generates


class SeqStatus(Enum):
    WAITING = auto()  # needs blocks (new, or preempted for recompute)
    RUNNING = auto()  # has blocks, gets compute every step
    HELD = auto()  # HOLD mode, all KV computed: waits for extend() or release()
    PREFILLED = auto()  # PREFILL mode done: blocks kept until release()
    DONE = auto()  # finished, aborted or released: no blocks, the engine forgot it


class Sequence:
    def __init__(
        self,
        rid: str,
        token_ids: list[int],
        params: SamplingParams,
        num_prompt_tokens: int,
        mode: Mode,
        seed: int,
        arrival: int,
    ) -> None:
        self.rid = rid
        self.token_ids = list(token_ids)
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.mode = mode
        self.seed = seed
        self.arrival = arrival  # admission order: the youngest is preempted first
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        # Tokens whose KV is in the pool (cached prefix included). Every full block among
        # them is in the prefix cache too: the scheduler registers blocks as they fill.
        self.num_computed_tokens = 0
        self.hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.last_logits: torch.Tensor | None = None  # held seqs: logits of the last token
        # Collected chunk by chunk when the request asked for them and samples output 0 here.
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        if params.prompt_logprobs is not None and len(token_ids) == num_prompt_tokens:
            self.prompt_logprobs = []
        self.grammar: GrammarState | None = None  # a constrained request's matcher (grammar.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
