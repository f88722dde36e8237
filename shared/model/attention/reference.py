"""Reference attention: gather each sequence's context from the pool, then SDPA.

Decodes (the first num_decode sequences) are attended in one padded, masked SDPA call;
every other sequence (a prefill chunk or an extend of several tokens) gets its own call.
Runs on any device; the numerical reference the paged kernel is held to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.model.attention.context import AttentionContext


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """[H, n, D] x [KVH, L, D] -> [H, n, D]. Always 4-D: on CPU a 3-D call falls back to the
    unfused math kernel (~50x slower here), a 4-D one takes the flash kernel, GQA included."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **kw)[0]


def causal_offset_mask(length: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position context_len - length + i) sees keys 0..that position."""
    q_pos = torch.arange(context_len - length, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    return k_pos <= q_pos


@dataclass
class Chunk:
    start: int  # first row in the flat batch
    length: int  # new tokens of this sequence in the batch
    context_len: int  # tokens visible to the last query: cached + new
    block_table: torch.Tensor  # [num_blocks] int64, covers context_len
    mask: torch.Tensor | None  # [length, context_len] bool when a cached prefix precedes it


@dataclass
class Plan:
    """The step's gather indices and masks, made once for all layers."""

    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    chunks: list[Chunk]


def make_plan(ctx: AttentionContext) -> Plan:
    device, bs, nd = ctx.kv_cache.device, ctx.block_size, ctx.num_decode
    starts, lens = ctx.query_start.tolist(), ctx.seq_lens.tolist()
    tables, masks = None, None
    if nd:
        width = -(-max(lens[:nd]) // bs)
        tables = ctx.block_tables[:nd, :width].long().to(device)
        mask = torch.arange(width * bs)[None, :] < ctx.seq_lens[:nd, None]
        masks = mask.view(nd, 1, 1, width * bs).to(device)
    chunks = []
    for b in range(nd, len(lens)):
        n, total = starts[b + 1] - starts[b], lens[b]
        table = ctx.block_tables[b, : -(-total // bs)].long().to(device)
        mask = causal_offset_mask(n, total, device) if total > n else None
        chunks.append(Chunk(starts[b], n, total, table, mask))
    return Plan(tables, masks, chunks)


class ReferenceBackend:
    name = "reference"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        if ctx.prepared is None:
            ctx.prepared = make_plan(ctx)
        plan: Plan = ctx.prepared
        _, _, kvh, d = k_cache.shape
        num_heads = q.shape[1]
        out = torch.empty_like(q)
        nd = ctx.num_decode
        if nd:
            assert plan.decode_block_tables is not None
            # The query heads of one KV head become that head's query rows: no K/V repeat.
            flat = plan.decode_block_tables.flatten()  # index_select: several times faster than [] on CPU
            keys = k_cache.index_select(0, flat).view(nd, -1, kvh, d).transpose(1, 2)
            vals = v_cache.index_select(0, flat).view(nd, -1, kvh, d).transpose(1, 2)
            qd = q[:nd].view(nd, kvh, num_heads // kvh, d)
            od = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=plan.decode_mask)
            out[:nd] = od.reshape(nd, num_heads, d)
        for c in plan.chunks:
            qc = q[c.start : c.start + c.length].transpose(0, 1)
            if c.mask is None:  # nothing cached before it: attend to itself
                kc = k[c.start : c.start + c.length].transpose(0, 1)
                vc = v[c.start : c.start + c.length].transpose(0, 1)
                oc = sdpa(qc, kc, vc, is_causal=True)
            else:
                kc = k_cache.index_select(0, c.block_table).view(-1, kvh, d)[: c.context_len].transpose(0, 1)
                vc = v_cache.index_select(0, c.block_table).view(-1, kvh, d)[: c.context_len].transpose(0, 1)
                oc = sdpa(qc, kc, vc, attn_mask=c.mask)
            out[c.start : c.start + c.length] = oc.transpose(0, 1)
        return out
