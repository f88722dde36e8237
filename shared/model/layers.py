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


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN, as transformers computes it: frequencies blended between interpolated and
    extrapolated along a ramp over the dimensions, and cos/sin scaled by the attention factor."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def rope_parameters(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor cos and sin are scaled by)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "freq_factors":  # a GGUF's rope_freqs tensor: one divisor per frequency
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    elif kind == "yarn":
        return _yarn(inv_freq, dim, config.rope_theta, scaling)
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
    elif kind is not None:
        raise ValueError(f"rope scaling {kind!r} is not implemented")
    return inv_freq, 1.0


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    return rope_parameters(config)[0]


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary absolute positions (rotate-half layout, as in HF Llama)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.scale = rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        if self.scale != 1.0:
            return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)
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
