"""A directory of KV blocks keyed by pdd chained hash, for engines in separate processes: one
file per pdd block, written atomically (a temporary file renamed into place), so a reader sees
a whole block or none.

A block is the bulk channel's group of one pdd block, [L, 2, 1, 16, kv_heads, head_dim]
(shared/kv/frame.py), stored as a small JSON header (dtype, shape) and the raw bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from pathlib import Path

import torch

from shared.kv.frame import DTYPES, byte_view, dtype_name

PREFIX = struct.Struct("!I")  # length of the JSON header


class BlockStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"directory store {self.root}"

    def path(self, block_hash: int) -> Path:
        return self.root / f"{block_hash:016x}.kv"

    def has(self, block_hash: int) -> bool:
        return self.path(block_hash).exists()

    def put(self, block_hash: int, group: torch.Tensor) -> None:
        """Store one block's group (any CPU tensor; a block already held is left as it is)."""
        if self.has(block_hash):
            return
        group = group.contiguous()
        header = json.dumps({"dtype": dtype_name(group.dtype), "shape": list(group.shape)}).encode()
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(PREFIX.pack(len(header)) + header)
                f.write(byte_view(group))
            os.replace(tmp, self.path(block_hash))
        except BaseException:
            os.unlink(tmp)
            raise

    def get(self, block_hash: int) -> torch.Tensor:
        """The group stored under block_hash; KeyError if there is none."""
        try:
            data = self.path(block_hash).read_bytes()
        except FileNotFoundError:
            raise KeyError(block_hash) from None
        (n,) = PREFIX.unpack_from(data)
        header = json.loads(data[PREFIX.size : PREFIX.size + n])
        dtype, shape = DTYPES[header["dtype"]], header["shape"]
        payload = bytearray(data[PREFIX.size + n :])
        if len(payload) != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"block {block_hash:016x}: {len(payload)} bytes do not make {shape} {dtype}")
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape)

    def held_run(self, block_hashes: list[int]) -> int:
        """How many of the blocks, from the first, the store holds."""
        n = 0
        while n < len(block_hashes) and self.has(block_hashes[n]):
            n += 1
        return n
