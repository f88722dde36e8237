"""Sequence: one request's tokens, blocks and progress. Plain data; the scheduler moves it."""

from __future__ import annotations

from enum import Enum, auto

import torch

from shared.engine.sampling_params import SamplingParams


class SeqStatus(Enum):
    WAITING = auto()  # needs blocks (new, or preempted for recompute)
    RUNNING = auto()  # has blocks, gets compute every step
    HELD = auto()  # "hold" mode, all KV computed: waits for extend() or release()
    FINISHED = auto()  # "prefill" mode done: blocks kept until release()


class Sequence:
    def __init__(
        self, rid: str, token_ids: list[int], params: SamplingParams, num_prompt_tokens: int,
        mode: str, seed: int, arrival: int,
    ) -> None:  # fmt: skip
        self.rid = rid
        self.token_ids = list(token_ids)
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.mode = mode  # "generate" | "prefill" | "hold"
        self.seed = seed
        self.arrival = arrival  # admission order: the youngest is preempted first
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the pool (cached prefix included)
        self.num_registered_blocks = 0  # leading full blocks that are in the prefix cache
        self.hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.last_logits: torch.Tensor | None = None  # held seqs: logits of the last token

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
