"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over flat token batches.

Parameter names follow Hugging Face, except that q/k/v and gate/up are packed into one
matmul each (`qkv_proj`, `gate_up_proj`); the loader and the exporter split/merge them.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from shared.model.attention import Attention, AttentionContext
from shared.model.config import ModelConfig
from shared.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, split_qkv_rope


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)
        self.fused: ModuleType | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext | None
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.qk_norm:  # Qwen3: a norm per head before RoPE
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            q, k, v = split_qkv_rope(
                qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, self.fused
            )
        o = self.attn(q, k, v, ctx)
        return self.o_proj(o.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: AttentionContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer (or the
        final norm) adds the two, so each add goes with a norm in one call where fused."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin, ctx), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext | None = None
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def dense_logits(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Reference path: one whole sequence, no KV cache -> logits [T, vocab] in fp32."""
        device = self.model.embed_tokens.weight.device
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
        positions = torch.arange(ids.numel(), device=device)
        return self.compute_logits(self.forward(ids, positions, None)).float()
