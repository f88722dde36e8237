"""A model's shape, as far as step times and KV sizes go (dense Llama-family decoders)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2

    @property
    def params(self) -> int:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (q_o + k_v + mlp) + 2 * self.vocab * self.hidden  # + embeddings, lm_head

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Matrix FLOPs of one token through every projection and the lm_head (the embedding
        lookup computes nothing)."""
        return 2 * (self.params - self.vocab * self.hidden)

    @property
    def flops_per_attn_pair(self) -> int:
        """FLOPs of one query attending to one key in every layer (QKᵀ and PV)."""
        return 4 * self.layers * self.heads * self.head_dim
