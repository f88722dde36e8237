"""ModelRunner: turns a scheduled batch into one forward over the paged KV cache.

Single-token steps (decodes) go first in the flat batch and share one padded attention
call; every multi-token piece (a prefill chunk, an extend) is a Chunk of its own.
"""

from __future__ import annotations

import torch

from shared.engine.block_pool import blocks_for
from shared.engine.scheduler import ScheduledSeq
from shared.model.attention import AttentionContext, Chunk, causal_offset_mask
from shared.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device

    @torch.inference_mode()
    def run(
        self, batch: list[ScheduledSeq], want_logits: list[bool], every_row: list[bool] | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Compute KV for every scheduled token; return fp32 logits of the last token of
        each sequence with want_logits set, in batch order ([N, vocab]), and for each batch
        index with every_row set the fp32 logits of all its tokens of this step ([num_new, vocab])."""
        bs = self.block_size
        order = sorted(range(len(batch)), key=lambda j: batch[j].num_new > 1)  # decodes first, stable
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []  # where each new token's K/V goes: block * block_size + offset
        last_row: dict[int, int] = {}
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        chunks: list[Chunk] = []
        for j in order:
            seq, n = batch[j].seq, batch[j].num_new
            start, c = len(ids), seq.num_computed_tokens
            ids += seq.token_ids[c : c + n]
            table = seq.block_table[: blocks_for(c + n, bs)]
            pos += range(c, c + n)
            slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
            if n == 1:
                dec_tables.append(table)
                dec_lens.append(c + 1)
            else:
                # Built once per step, not once per layer.
                mask = causal_offset_mask(n, c + n, self.device) if c else None
                chunks.append(
                    Chunk(start, n, c + n, torch.tensor(table, dtype=torch.long, device=self.device), mask)
                )
            last_row[j] = start + n - 1
        ctx = AttentionContext(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode=len(dec_tables),
            chunks=chunks,
        )
        if dec_tables:
            width = max(len(t) for t in dec_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.long)
            mask = torch.arange(width * bs)[None, :] < torch.tensor(dec_lens)[:, None]
            ctx.decode_block_tables = tables.to(self.device)
            ctx.decode_mask = mask.view(len(dec_tables), 1, 1, width * bs).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, ctx)
        every = self._every_row_logits(hidden, batch, last_row, every_row or [])
        rows = [last_row[j] for j in range(len(batch)) if want_logits[j]]
        if not rows:
            return torch.empty(0, self.model.config.vocab_size, device=self.device), every
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float(), every

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
