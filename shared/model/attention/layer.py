"""The attention layer: writes the step's new K/V into the paged cache (one C++ call where the
small ops are fused), then lets the step's backend attend (or, with no context, one dense
causal sequence)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from shared.model.attention.context import AttentionContext
from shared.model.attention.reference import sdpa


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.fused: ModuleType | None = None  # the fused ops' store_kv (shared/model/fused.py)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext | None
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D]."""
        if ctx is None:  # dense: one sequence, no cache
            return sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(
                0, 1
            )
        k_cache, v_cache = ctx.kv_cache[self.layer_idx, 0], ctx.kv_cache[self.layer_idx, 1]
        if self.fused is not None:
            self.fused.store_kv(ctx.kv_cache, self.layer_idx, ctx.slot_mapping, k, v)
        else:
            _, _, kvh, d = k_cache.shape
            k_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, k)
            v_cache.view(-1, kvh, d).index_copy_(0, ctx.slot_mapping, v)
        return ctx.backend.forward(q, k, v, k_cache, v_cache, ctx)
