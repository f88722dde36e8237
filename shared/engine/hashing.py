"""Chained block hashes: the identity of a full KV block in every process.

hash(block i) = blake2b-64(parent hash, model id, the block's token IDs), masked to 63
bits. Pure and process-independent (no Python `hash`), so the router, prefill, relay
and main decode compute the same value for the same prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

MASK63 = (1 << 63) - 1
_ROOT = b"\xff" * 8  # parent of the first block; no masked hash can equal it


def hash_block(parent: int | None, token_ids: Sequence[int], model_id: str) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT if parent is None else parent.to_bytes(8, "little"))
    mid = model_id.encode()
    h.update(len(mid).to_bytes(4, "little"))
    h.update(mid)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little") & MASK63


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, model_id: str) -> None:
    """Append the hashes of full blocks of token_ids not yet in `hashes` (in place)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], model_id))


def block_hashes(token_ids: Sequence[int], block_size: int, model_id: str) -> list[int]:
    """Hashes of the full blocks of token_ids, in order (a trailing partial block has none)."""
    out: list[int] = []
    extend_block_hashes(out, token_ids, block_size, model_id)
    return out
