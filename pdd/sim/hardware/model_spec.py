"""A model's shape, as far as step times and KV sizes go: Llama-family decoders, dense or with
mixture-of-experts MLPs, and hybrid attention (only some layers keep a per-token KV)."""

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
    dtype_bytes: int = 2  # the weights'
    kv_dtype_bytes: int | None = None  # the KV cache's (fp8: 1); None: the weights'
    experts: int = 0  # routed experts per layer (0: a dense MLP of `intermediate`)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    kv_layers: int | None = None  # layers with full attention and a per-token KV; None: all
    kv_token_bytes: int | None = None  # a compressed KV's bytes per token (None: from the shape)
    attn_pair_flops: int | None = None  # its FLOPs per query-key pair, all layers (None: from the shape)
    expert_parallel: bool = False  # served with its routed experts spread over a group of chips
    tied_embeddings: bool = False  # lm_head shares the embedding's weights (stored once)

    @property
    def attn_layers(self) -> int:
        return self.layers if self.kv_layers is None else self.kv_layers

    def _layer_params(self, experts: int) -> int:
        # Linear-attention layers of a hybrid model are counted like attention layers: their
        # projections are of the same order, and their per-token state update is small.
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        if not self.experts:
            return q_o + k_v + 3 * self.hidden * self.intermediate
        mlp = 3 * self.hidden * (experts * self.expert_intermediate + self.shared_expert_intermediate)
        return q_o + k_v + mlp + self.hidden * self.experts  # + the router

    @property
    def _embedding_params(self) -> int:
        """The embedding and the lm_head (one matrix when tied)."""
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self._layer_params(self.experts) + self._embedding_params

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (all of them for a dense model)."""
        if not self.experts:
            return self.params
        return self.layers * self._layer_params(self.experts_per_token) + self._embedding_params

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def routed_expert_params(self) -> int:
        return self.layers * 3 * self.hidden * self.experts * self.expert_intermediate

    def resident_weight_bytes(self, group: int = 1) -> int:
        """Weights one instance holds: all of them, or with expert parallelism over `group` chips
        its share of the routed experts and a copy of the rest."""
        if not self.expert_parallel or group <= 1:
            return self.weight_bytes
        routed = self.routed_expert_params * self.dtype_bytes
        return self.weight_bytes - routed + -(-routed // group)

    @property
    def kv_bytes_per_token(self) -> int:
        if self.kv_token_bytes is not None:
            return self.kv_token_bytes
        kv_dtype = self.kv_dtype_bytes or self.dtype_bytes
        return 2 * self.attn_layers * self.kv_heads * self.head_dim * kv_dtype

    @property
    def flops_per_token(self) -> int:
        """Matrix FLOPs of one token through every projection it uses and the lm_head (the
        embedding lookup computes nothing)."""
        return 2 * (
            self.layers * self._layer_params(self.experts_per_token or self.experts)
            + self.vocab * self.hidden
        )

    @property
    def flops_per_attn_pair(self) -> int:
        """FLOPs of one query attending to one key in every full-attention layer (QKᵀ and PV)."""
        if self.attn_pair_flops is not None:
            return self.attn_pair_flops
        return 4 * self.attn_layers * self.heads * self.head_dim
