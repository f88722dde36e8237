"""KV codecs of the bulk channel: what a block group looks like on the wire.

`exact` (the default) sends the engine's bytes as they are. The lossy codecs quantize every
(layer, K/V, block, KV head) run of block_size x head_dim values with one fp32 scale, its
absolute max mapped to the top of the code range (symmetric, no zero point):

    int8   round(x / s), s = absmax / 127          1 byte a value     max error s / 2
    fp8    x / s in float8 e4m3, s = absmax / 448   1 byte a value     relative error <= 2^-4
    int4   round(x / s), s = absmax / 7, 2 a byte   0.5 byte a value   max error s / 2

On the wire a quantized group is a uint8 tensor [L, layer_bytes]; each layer row holds its
values ([2, n, block_size, kv_heads, head_dim], packed) then its scales ([2, n, kv_heads]
fp32), so a group still cuts along layers into sub-frames and pieces like an exact one. The
receiver decodes it back to the engine dtype before its sink sees it: a decoded block is an
ordinary block there (and enters a main decoder's prefix cache as such).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EXACT = "exact"
# code range of each lossy codec: |x / s| <= this
_TOP = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
CODECS: tuple[str, ...] = (EXACT, *_TOP)
_SCALE_BYTES = 4  # fp32

# Conservative CPU throughput of encode and decode together, engine bytes per second, one
# thread (`pdd bench bandwidth --codec-only`, tiny and small presets): on a quiet 2-core host
# int8 540-1150 MB/s, fp8 350-525, int4 460-765; with the host 6x oversubscribed 3-6x less
# (int8 106-160). These sit 2-4x under the quiet figures; the simulator charges them.
CODEC_BYTES_PER_S: dict[str, float] = {EXACT: math.inf, "int8": 250e6, "fp8": 150e6, "int4": 150e6}


@dataclass(frozen=True)
class Encoded:
    """A block group in a lossy codec, ready for the wire."""

    codec: str
    shape: tuple[int, ...]  # the engine's [L, 2, n, block_size, kv_heads, head_dim]
    dtype: torch.dtype  # the engine's
    data: torch.Tensor  # uint8 [L, layer_bytes], contiguous, on the CPU

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; known: {', '.join(CODECS)}")
    return name


def _value_bytes(codec: str, values: int) -> int:
    return values // 2 if codec == "int4" else values


def layer_bytes(codec: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    """Wire bytes of one layer of a group of `shape` (the engine's) and `dtype` in `codec`."""
    check_codec(codec)
    _, kv2, n, block_size, heads, head_dim = shape
    values = kv2 * n * block_size * heads * head_dim
    if codec == EXACT:
        return values * dtype.itemsize
    if codec == "int4" and head_dim % 2:
        raise ValueError(f"int4 packs two values a byte: head_dim {head_dim} must be even")
    return _value_bytes(codec, values) + kv2 * n * heads * _SCALE_BYTES


def bytes_ratio(codec: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> float:
    """Engine bytes over wire bytes (1.0 for exact)."""
    per_layer = layer_bytes(codec, shape, dtype)
    return layer_bytes(EXACT, shape, dtype) / per_layer if per_layer else 1.0


def encode(codec: str, kv: torch.Tensor) -> Encoded:
    """kv [L, 2, n, block_size, kv_heads, head_dim] (any float dtype, any device) in a lossy codec."""
    check_codec(codec)
    if codec == EXACT:
        raise ValueError("exact groups travel as they are: nothing to encode")
    if kv.dim() != 6:
        raise ValueError(f"kv must be [L, 2, n, block_size, kv_heads, head_dim], not {tuple(kv.shape)}")
    shape = tuple(kv.shape)
    n_layers = shape[0]
    wire = layer_bytes(codec, shape, kv.dtype)  # validates int4's head_dim
    x = kv.detach().to("cpu", torch.float32)
    top = _TOP[codec]
    scale = x.abs().amax(dim=(3, 5)) / top  # [L, 2, n, H]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero run stays zero
    y = x / scale[:, :, :, None, :, None]
    if codec == "fp8":
        q = y.clamp_(-top, top).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = y.round_().clamp_(-top, top).to(torch.int8)
        if codec == "int4":
            q = (q + 8).to(torch.uint8)  # 1..15
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        else:
            q = q.view(torch.uint8)
    data = torch.cat((q.reshape(n_layers, -1), scale.reshape(n_layers, -1).view(torch.uint8)), dim=1)
    assert data.shape[1] == wire or n_layers == 0
    return Encoded(codec, shape, kv.dtype, data.contiguous())


def decode(
    codec: str, data: torch.Tensor, shape: tuple[int, ...] | list[int], dtype: torch.dtype
) -> torch.Tensor:
    """The engine's tensor of `shape` and `dtype` back from a lossy codec's wire bytes
    (uint8, [L, layer_bytes] or flat)."""
    check_codec(codec)
    if codec == EXACT:
        raise ValueError("exact groups travel as they are: nothing to decode")
    shape = tuple(shape)
    n_layers, kv2, n, block_size, heads, head_dim = shape
    wire = layer_bytes(codec, shape, dtype)
    data = data.reshape(n_layers, wire)
    values = kv2 * n * block_size * heads * head_dim
    nq = _value_bytes(codec, values)
    q = data[:, :nq]
    scale = data[:, nq:].contiguous().view(torch.float32).reshape(n_layers, kv2, n, heads)
    if codec == "fp8":
        y = q.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    elif codec == "int4":
        packed = q.reshape(n_layers, kv2, n, block_size, heads, head_dim // 2)
        y = torch.stack(((packed & 0xF), (packed >> 4)), dim=-1).to(torch.float32) - 8.0
    else:
        y = q.contiguous().view(torch.int8).to(torch.float32)
    y = y.reshape(shape) * scale[:, :, :, None, :, None]
    return y.to(dtype)


_WIRE_RATIO = "_pdd_wire_ratio"


def mark_wire(kv: torch.Tensor, wire_nbytes: int) -> torch.Tensor:
    """Note on a decoded group how many bytes it took on the wire (for what a receiver counts)."""
    setattr(kv, _WIRE_RATIO, kv.numel() * kv.element_size() / max(wire_nbytes, 1))
    return kv


def wire_nbytes(kv: torch.Tensor, ratio: float | None = None) -> int:
    """The bytes `kv` (or the part of it a receiver kept) took on the wire: its own size unless
    mark_wire noted a codec's. `ratio`: one read off the whole group before it was sliced."""
    ratio = getattr(kv, _WIRE_RATIO, 1.0) if ratio is None else ratio
    return round(kv.numel() * kv.element_size() / ratio)


def wire_ratio(kv: torch.Tensor) -> float:
    return getattr(kv, _WIRE_RATIO, 1.0)


def round_trip(codec: str, kv: torch.Tensor) -> torch.Tensor:
    """kv as the receiver would hold it after the wire (kv itself for exact)."""
    if codec == EXACT:
        return kv
    enc = encode(codec, kv)
    return decode(codec, enc.data, enc.shape, enc.dtype).to(kv.device)
