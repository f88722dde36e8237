"""Attention over a paged KV cache (or dense, for references and parity checks).

One forward carries a flat batch of tokens from many sequences. Rows [0, num_decode) are
single-token steps (decodes); they are attended in one padded, masked SDPA call. Every
other sequence (a prefill chunk or an extend of several tokens) is one `Chunk`, attended
with its own SDPA call. New K/V are written into the cache first, so every query reads
its whole context, cached prefix included, from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Chunk:
    start: int  # first row in the flat batch
    length: int  # new tokens of this sequence in the batch
    context_len: int  # tokens visible to the last query: cached + new
    block_table: torch.Tensor  # [num_blocks] int64, covers context_len
    mask: torch.Tensor | None = None  # [length, context_len] bool when a cached prefix precedes it


@dataclass
class AttentionContext:
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (block * block_size + offset)
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int64, padded with 0
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size] bool
    chunks: list[Chunk] = field(default_factory=list)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """[H, n, D] x [KVH, L, D] -> [H, n, D]. Always 4-D: on CPU a 3-D call falls back to the
    unfused math kernel (~50x slower here), a 4-D one takes the flash kernel, GQA included."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True, **kw)[0]


def causal_offset_mask(length: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position context_len - length + i) sees keys 0..that position."""
    q_pos = torch.arange(context_len - length, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    return k_pos <= q_pos


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext | None
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D]."""
        if ctx is None:  # dense: one sequence, no cache
            return _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
        k_cache, v_cache = ctx.kv_cache[self.layer_idx, 0], ctx.kv_cache[self.layer_idx, 1]
        _, bs, kvh, d = k_cache.shape
        k_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, v)
        out = torch.empty_like(q)
        nd = ctx.num_decode
        if nd:
            assert ctx.decode_block_tables is not None
            # The query heads of one KV head become that head's query rows: no K/V repeat.
            flat = ctx.decode_block_tables.flatten()  # index_select: several times faster than [] on CPU
            keys = k_cache.index_select(0, flat).view(nd, -1, kvh, d).transpose(1, 2)
            vals = v_cache.index_select(0, flat).view(nd, -1, kvh, d).transpose(1, 2)
            qd = q[:nd].view(nd, kvh, self.group, d)
            od = F.scaled_dot_product_attention(qd, keys, vals, attn_mask=ctx.decode_mask)
            out[:nd] = od.reshape(nd, self.num_heads, d)
        for c in ctx.chunks:
            qc = q[c.start : c.start + c.length].transpose(0, 1)
            if c.mask is None:  # nothing cached before it: attend to itself
                kc = k[c.start : c.start + c.length].transpose(0, 1)
                vc = v[c.start : c.start + c.length].transpose(0, 1)
                oc = _sdpa(qc, kc, vc, is_causal=True)
            else:
                kc = k_cache.index_select(0, c.block_table).view(-1, kvh, d)[: c.context_len].transpose(0, 1)
                vc = v_cache.index_select(0, c.block_table).view(-1, kvh, d)[: c.context_len].transpose(0, 1)
                oc = _sdpa(qc, kc, vc, attn_mask=c.mask)
            out[c.start : c.start + c.length] = oc.transpose(0, 1)
        return out
