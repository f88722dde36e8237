"""Small building blocks: RMSNorm, rotary embedding, SwiGLU.

RMSNorm, RoPE and SwiGLU's activation take a C++ call each (shared/model/kernels/fused_ops.cpp)
once the model is given the fused ops (`shared.model.fused.use_fused_ops`); the tensor code
here stays the reference they round like.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.is_contiguous():
            return self.fused.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32, scale in the model dtype: the same rounding as the reference.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): the residual add and the norm in one call
        where fused (both tensors then updated in place: x is a layer's output, used once)."""
        if self.fused is not None and x.is_contiguous() and residual.is_contiguous():
            self.fused.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary absolute positions (rotate-half layout, as in HF Llama)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def split_qkv_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    fused: ModuleType | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (heads + 2 kv_heads) head_dim] -> q, k rotated and v, as [T, heads, head_dim]."""
    v = qkv[:, (heads + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
    if fused is not None and qkv.is_contiguous():
        q, k = fused.rope_qk(qkv, cos, sin, heads, kv_heads)
        return q, k, v
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    q = apply_rope(q.view(-1, heads, head_dim), cos, sin)
    return q, apply_rope(k.reshape(-1, kv_heads, head_dim), cos, sin), v


class SwiGLU(nn.Module):
    """gate and up packed in one matmul (nano-vllm style); silu(gate) * up, then down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.fused: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
