"""What one step tells every attention layer (built once by the model runner, read by all),
and the backend each layer hands it to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class AttentionContext:
    """A flat batch of B sequences: sequence b owns rows query_start[b] .. query_start[b+1] of
    the batch (its new tokens) and sees seq_lens[b] tokens, the new ones last. Single-token
    sequences (decodes) come first: num_decode of them. The int32 tables stay on the host
    (the CPU kernel reads them there; a backend on another device copies what it needs once
    per step, in `prepared`)."""

    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] int64 on the cache's device: block * block_size + offset per new token
    query_start: torch.Tensor  # [B + 1] int32, host
    seq_lens: torch.Tensor  # [B] int32, host
    block_tables: torch.Tensor  # [B, max_blocks] int32, host, padded with block 0
    num_decode: int
    backend: AttentionBackend
    prepared: Any = None  # the backend's own per-step data, made by its first layer

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[3]


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] (already in the cache) -> [T, H, D]."""
        ...
