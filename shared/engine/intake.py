"""Request intake: every check on a new request or an extend, before the engine takes it.

A refused call raises InvalidRequestError with a message a client can act on, and leaves the
engine as it was.
"""

from __future__ import annotations

import secrets
from collections.abc import Container
from collections.abc import Sequence as Seq

import torch

from shared.engine.block_pool import blocks_for
from shared.engine.errors import InvalidRequestError
from shared.engine.kv_admission import request_blocks
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import Mode, Sequence

MODES = ", ".join(Mode)


class RequestIntake:
    def __init__(self, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._arrival = 0  # admission order handed to the next sequence

    def new_sequence(
        self,
        rid: str,
        token_ids: Seq[int],
        params: SamplingParams,
        *,
        num_prompt_tokens: int | None,
        mode: Mode,
        taken: Container[str],
    ) -> Sequence:
        """A checked Sequence for a new request; `taken` holds the ids already in use."""
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request id must be a non-empty string")
        if rid in taken:
            raise InvalidRequestError(f"request {rid!r} already exists")
        mode = _check_mode(mode)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        params.validate()
        self.check_token_ids(list(params.logit_bias), "logit_bias")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        ids = self.check_token_ids(token_ids, "prompt")
        npt = self._check_lengths(len(ids), params, num_prompt_tokens, mode)
        self._check_fits_pool(len(ids), npt, params, mode)
        # An unseeded request still gets a fixed seed: any instance resuming it draws the same.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(rid, ids, params, npt, mode, seed, self._arrival)
        self._arrival += 1
        return seq

    def check_extend(self, seq: Sequence, token_ids: Seq[int]) -> list[int]:
        """The tokens to append to a held sequence, checked."""
        if seq.mode is not Mode.HOLD:
            raise InvalidRequestError(f"request {seq.rid!r} is not held (mode {str(seq.mode)!r})")
        ids = self.check_token_ids(token_ids, "extend")
        total = seq.num_tokens + len(ids)
        if total >= self.max_model_len:
            raise InvalidRequestError(f"extend to {total} tokens reaches max_model_len {self.max_model_len}")
        if total - seq.num_prompt_tokens >= seq.params.max_tokens:
            raise InvalidRequestError(
                f"extend to {total - seq.num_prompt_tokens} output tokens leaves nothing to generate "
                f"(max_tokens {seq.params.max_tokens})"
            )
        return ids

    def check_token_ids(self, token_ids: Seq[int], what: str) -> list[int]:
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Seq | torch.Tensor):
            raise InvalidRequestError(f"{what} token ids must be a list of integers")
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"{what} token ids must be integers, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"{what} token id {t} is out of the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def _check_lengths(
        self, n: int, params: SamplingParams, num_prompt_tokens: int | None, mode: Mode
    ) -> int:
        """num_prompt_tokens, defaulted and checked against the prompt, max_model_len and max_tokens."""
        if n == 0:
            raise InvalidRequestError("prompt is empty: give at least one token")
        npt = n if num_prompt_tokens is None else num_prompt_tokens
        if isinstance(npt, bool) or not isinstance(npt, int) or not 1 <= npt <= n:
            raise InvalidRequestError(f"num_prompt_tokens must be in [1, {n}], got {num_prompt_tokens!r}")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"{n} tokens leave no room to generate: max_model_len is {self.max_model_len}"
            )
        if mode is not Mode.PREFILL and n - npt >= params.max_tokens:
            raise InvalidRequestError(f"already {n - npt} output tokens, max_tokens is {params.max_tokens}")
        return npt

    def _check_fits_pool(self, n: int, npt: int, params: SamplingParams, mode: Mode) -> None:
        if mode is Mode.PREFILL:
            final_len, need = n + 1, blocks_for(n, self.block_size)
        else:
            final_len = min(npt + params.max_tokens, self.max_model_len)
            need = request_blocks(npt, params.max_tokens, self.max_model_len, self.block_size)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request needs up to {need} KV blocks ({final_len - 1} tokens), "
                f"the whole pool has {self.num_blocks}: shorten the prompt or max_tokens"
            )


def _check_mode(mode: Mode | str) -> Mode:
    try:
        return Mode(mode)
    except ValueError:
        raise InvalidRequestError(f"mode must be one of {MODES}, got {mode!r}") from None
