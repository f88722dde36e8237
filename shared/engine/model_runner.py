"""ModelRunner: turns a scheduled batch into one forward over the paged KV cache.

Single-token steps (decodes) go first in the flat batch. The step's metadata (token ids,
positions, KV slots, block tables, query starts, context lengths) is built with array
operations over whole sequences, never token by token, and crosses to the device once per
tensor; every layer then reads it from one AttentionContext.
"""

from __future__ import annotations

import logging
from itertools import chain

import numpy as np
import torch

from shared.engine.scheduler import ScheduledSeq
from shared.model.attention import AttentionContext, attention_backend
from shared.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int, attention: str = "auto"
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.backend = attention_backend(attention, self.device)
        log.info("attention backend: %s (asked for %s)", self.backend.name, attention)

    @torch.inference_mode()
    def run(
        self, batch: list[ScheduledSeq], want_logits: list[bool], every_row: list[bool] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Compute KV for every scheduled token; return fp32 logits of the last token of
        each sequence with want_logits set, in batch order ([N, vocab]), and for each batch
        index with every_row set the fp32 logits of all its tokens of this step ([num_new, vocab])."""
        bs, b = self.block_size, len(batch)
        order = sorted(range(b), key=lambda j: batch[j].num_new > 1)  # decodes first, stable
        seqs = [batch[j].seq for j in order]
        n_new = np.fromiter((batch[j].num_new for j in order), np.int64, b)
        computed = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, b)
        seq_lens = computed + n_new
        query_start = np.zeros(b + 1, np.int64)
        np.cumsum(n_new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        pieces = zip(seqs, computed.tolist(), n_new.tolist(), strict=True)
        ids = np.fromiter(
            chain.from_iterable(s.token_ids[c : c + n] for s, c, n in pieces), np.int64, num_tokens
        )
        # Block tables, padded with block 0: row-major fill of each row's first num_blocks entries.
        num_blocks = -(-seq_lens // bs)
        tables = np.zeros((b, int(num_blocks.max())), np.int32)
        tables[np.arange(tables.shape[1])[None, :] < num_blocks[:, None]] = np.fromiter(
            chain.from_iterable(s.block_table[:k] for s, k in zip(seqs, num_blocks.tolist(), strict=True)),
            np.int32,
            int(num_blocks.sum()),
        )
        row_seq = np.repeat(np.arange(b), n_new)  # which sequence each row belongs to
        positions = np.arange(num_tokens) + np.repeat(computed - query_start[:-1], n_new)
        slots = tables[row_seq, positions // bs].astype(np.int64) * bs + positions % bs
        ctx = AttentionContext(
            kv_cache=self.kv_cache,
            slot_mapping=self._to_device(slots),
            query_start=torch.from_numpy(query_start.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_tables=torch.from_numpy(tables),
            num_decode=int(np.count_nonzero(n_new == 1)),
            backend=self.backend,
        )
        hidden = self.model(self._to_device(ids), self._to_device(positions), ctx)
        last_row = dict(zip(order, (query_start[1:] - 1).tolist(), strict=True))
        every = self._every_row_logits(hidden, batch, last_row, every_row or [])
        rows = [last_row[j] for j in range(b) if want_logits[j]]
        if not rows:
            return torch.empty(0, self.model.config.vocab_size, device=self.device), every
        return self.model.compute_logits(hidden[self._to_device(np.array(rows))]).float(), every

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """int64 host array -> tensor on the cache's device: a view on the CPU, one copy elsewhere."""
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def _every_row_logits(
        self, hidden: torch.Tensor, batch: list[ScheduledSeq], last_row: dict[int, int], every_row: list[bool]
    ) -> dict[int, torch.Tensor]:
        """Apart from the last rows, so a request's sampling logits never depend on another's
        asking for every row (the same rows go through the same head call either way)."""
        return {
            j: self.model.compute_logits(hidden[last_row[j] - batch[j].num_new + 1 : last_row[j] + 1]).float()
            for j, wanted in enumerate(every_row)
            if wanted
        }
