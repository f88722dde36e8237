"""Paged attention on the CPU: one C++ call per layer reads K/V in place through the block
tables (shared/model/kernels/paged_attention.cpp): no gathered copy, no mask tensor."""

from __future__ import annotations

from types import ModuleType

import torch

from shared.model.attention.context import AttentionContext


class PagedCpuBackend:
    name = "paged"

    def __init__(self, ops: ModuleType) -> None:
        self.ops = ops

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        self.ops.paged_attention(
            out, q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx.query_start, q.shape[-1] ** -0.5
        )
        return out
