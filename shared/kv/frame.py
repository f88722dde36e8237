"""Wire format of the bulk channel.

    frame := u32 header_len (big endian) | msgpack header | header["nbytes"] raw bytes (blocks only)

Header kinds (client = KV sender, server = KV receiver):
    hello / auth / welcome / denied     handshake (see auth.py)
    blocks   c->s  rid, seq, hashes, layers [lo, hi), dtype, shape, nbytes, csum [algo, value], tp, codec
                   One send_blocks() call is one seq (a "group"); a big group is cut along the layer
                   dim into sub-frames of a few MiB (contiguous slices), so a slice is still in
                   cache when it is sent after hashing and no frame nears the size limit. `shape` is the
                   whole group's; `hashes` and `tp` (traceparent, str or nil) ride only on the
                   first sub-frame (lo == 0). A large group may be split over several connections
                   of the sender: then its first sub-frame also has split [gid, upto]: this
                   connection carries layers [0, upto), and [upto, L) come as piece frames.
                   codec (absent: "exact") names how the payload encodes the tensor
                   (shared/kv/codec.py); dtype and shape are always the decoded tensor's, and
                   nbytes the encoded layers'. A receiver fails the request of a codec it does not
                   know (the connection and its other requests go on).
    piece    c->s  rid, gid, layers [lo, hi), dtype, shape, nbytes, csum, codec  (lo >= 1)
                   Layers of split group `gid` sent on another connection of the same sender;
                   they land straight in the group's tensor, checksummed per frame, and the
                   group is delivered by its request's connection once every layer is in.
    done     c->s  rid, payload                    all blocks of rid were sent. payload: opaque bytes
                   (msgpack bin, b"" for none) handed to sink.on_done as is; the channel does not
                   read it (the services put an encoded bus message there). It rides in the header,
                   so the receiver's header limit bounds it (KVClient refuses a larger one before
                   sending); a payload that is not bytes drops the connection like any bad field.
    abort    c->s  rid, reason                     drop rid
    ack      s->c  rid                             sink.on_done returned
    error    s->c  rid, reason                     the receiver failed rid (checksum, sink raised, ...)
The tensor is [L, 2, n, block_size, kv_heads, head_dim], contiguous (an exact group's payload
is its bytes; a lossy codec's is a uint8 [L, layer_bytes], see codec.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from shared.kv.codec import CODECS, EXACT, layer_bytes
from shared.kv.errors import FrameError
from shared.kv.transport import Stream

PREFIX = struct.Struct("!I")
DEFAULT_MAX_HEADER = 1 << 20
DEFAULT_MAX_FRAME = 256 << 20
PREAUTH_MAX_HEADER = 4096  # an unauthenticated peer gets no more than this

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
    )
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot travel on the bulk channel")
    return name


def pack(header: dict[str, Any]) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(body)) + body


async def read_header(stream: Stream, max_header: int) -> dict[str, Any]:
    prefix = bytearray(PREFIX.size)
    await stream.recv_into(memoryview(prefix))
    (n,) = PREFIX.unpack(prefix)
    if n > max_header:
        raise FrameError(f"header of {n} bytes exceeds the limit of {max_header}")
    body = bytearray(n)
    await stream.recv_into(memoryview(body))
    try:
        header = msgpack.unpackb(body, raw=False)
    except Exception as e:
        raise FrameError(f"undecodable header: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise FrameError("header is not a map with a 'kind'")
    header["_hlen"] = PREFIX.size + n
    return header


def field(header: dict[str, Any], name: str, typ: type | tuple[type, ...]) -> Any:
    value = header.get(name)
    if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
        raise FrameError(f"{header.get('kind')} frame: bad or missing {name!r}")
    return value


@dataclass
class BlocksHeader:
    rid: str
    seq: int
    lo: int
    hi: int
    dtype: torch.dtype
    shape: list[int]
    nbytes: int  # of this sub-frame's payload
    layer_bytes: int
    algo: str
    csum: int
    split: tuple[int, int] | None = None  # (gid, upto) on a split group's first sub-frame
    codec: str = EXACT  # may be one this receiver does not know (layer_bytes is 0 then)

    @property
    def wire_shape(self) -> list[int]:
        """The shape of the tensor the payload lands in."""
        return self.shape if self.codec == EXACT else [self.shape[0], self.layer_bytes]

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.dtype if self.codec == EXACT else torch.uint8

    @property
    def held_nbytes(self) -> int:
        """What the whole group takes at the receiver once decoded (at least its payload): what
        it is reserved at against the caps."""
        return math.prod(self.shape) * self.dtype.itemsize


def check_blocks(header: dict[str, Any], max_frame: int) -> BlocksHeader:
    """Validate a blocks or piece header (any violation drops the connection)."""
    rid = field(header, "rid", str)
    piece = header["kind"] == "piece"
    seq = -1 if piece else field(header, "seq", int)
    dtype = DTYPES.get(field(header, "dtype", str))
    if dtype is None:
        raise FrameError(f"blocks frame: unknown dtype {header['dtype']!r}")
    shape = field(header, "shape", list)
    if len(shape) != 6 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FrameError("blocks frame: shape must be [L, 2, n, block_size, kv_heads, head_dim]")
    layers = field(header, "layers", list)
    if (
        len(layers) != 2
        or not all(isinstance(x, int) for x in layers)
        or not 0 <= layers[0] <= layers[1] <= shape[0]
    ):
        raise FrameError(f"blocks frame: bad layer range {layers}")
    lo, hi = layers
    if piece and lo == 0:
        raise FrameError("piece frame: layer 0 rides on the request's connection")
    if lo == 0:
        hashes = field(header, "hashes", list)
        if len(hashes) != shape[2] or not all(isinstance(h, int) for h in hashes):
            raise FrameError("blocks frame: hashes must be one int per block")
        if not isinstance(header.get("tp"), str | None):
            raise FrameError("blocks frame: tp must be a string or nil")
    codec = header.get("codec", EXACT)
    if not isinstance(codec, str):
        raise FrameError("blocks frame: codec must be a string")
    nbytes = field(header, "nbytes", int)
    if codec in CODECS:
        try:
            wire = layer_bytes(codec, shape, dtype)
        except ValueError as e:
            raise FrameError(f"blocks frame: {e}") from None
        if nbytes != (hi - lo) * wire:
            raise FrameError(
                f"blocks frame: nbytes {nbytes} does not match layers {layers} of {shape} {dtype} in {codec}"
            )
    else:  # the request fails, the frame is only read past
        wire = 0
        if nbytes < 0:
            raise FrameError(f"blocks frame: bad nbytes {nbytes}")
    if header["_hlen"] + nbytes > max_frame:
        raise FrameError(f"frame of {header['_hlen'] + nbytes} bytes exceeds the limit of {max_frame}")
    csum = field(header, "csum", list)
    if len(csum) != 2 or not isinstance(csum[0], str) or not isinstance(csum[1], int):
        raise FrameError("blocks frame: bad csum")
    b = BlocksHeader(rid, seq, lo, hi, dtype, shape, nbytes, wire, csum[0], csum[1], codec=codec)
    b.split = _split(header, shape[0]) if lo == 0 else None
    return b


def _split(header: dict[str, Any], n_layers: int) -> tuple[int, int] | None:
    split = header.get("split")
    if split is None:
        return None
    if (
        not isinstance(split, list)
        or len(split) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in split)
        or not 1 <= split[1] <= n_layers
    ):
        raise FrameError(f"blocks frame: bad split {split!r}")
    return split[0], split[1]


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying (works for bfloat16 too)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
