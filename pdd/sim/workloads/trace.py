"""Traces in the public Mooncake format (kvcache-ai/Mooncake, FAST25-release/README.md).

JSONL, one request per line:
    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}
timestamp: arrival in milliseconds since the trace's start; input_length / output_length:
tokens; hash_ids: one id per 512-token block of the prompt (the last one partial), equal ids
meaning a reusable prefix block. Read, each id becomes one of our chained block hashes, so the
trace's prefix sharing maps exactly; the trailing partial block is not hashed (our caches hold
full blocks only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdd.sim.workloads.workload import SimRequest, Workload
from shared.engine.hashing import hash_block

MOONCAKE_BLOCK = 512  # tokens per hash id in the published traces
_U32 = 0xFFFF_FFFF


class TraceError(ValueError):
    pass


def read_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK, limit: int | None = None) -> Workload:
    """The trace's first `limit` requests (all by default), in arrival order; block_size is the
    tokens per hash id (512 for Mooncake's traces; a trace written by write_mooncake says its own)."""
    path = Path(path)
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(_parse(line, block_size, f"{path}:{lineno}"))
    rows.sort(key=lambda r: r[0])  # stable: simultaneous arrivals keep the trace's order
    reqs = tuple(SimRequest(i, t, n_in, n_out, hashes) for i, (t, n_in, n_out, hashes) in enumerate(rows))
    return Workload(path.stem, block_size, reqs)


def _parse(line: str, block_size: int, where: str) -> tuple[float, int, int, tuple[int, ...]]:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected an object with timestamp, input_length, output_length, hash_ids")
    t = _field(d, "timestamp", (int, float), where)
    n_in = _field(d, "input_length", int, where)
    n_out = _field(d, "output_length", int, where)
    ids = _field(d, "hash_ids", list, where)
    if t < 0 or n_in < 1 or n_out < 0:
        raise TraceError(f"{where}: needs timestamp >= 0, input_length >= 1, output_length >= 0")
    full, blocks = n_in // block_size, math.ceil(n_in / block_size)
    if len(ids) not in (full, blocks) or not all(type(i) is int and 0 <= i < 1 << 64 for i in ids):
        raise TraceError(
            f"{where}: hash_ids must be {blocks} integers in [0, 2**64) (one per {block_size}-token "
            f"block of {n_in} tokens), got {len(ids)}"
        )
    return t / 1000.0, n_in, n_out, _chain(ids[:full])


def _field(d: dict, name: str, kind, where: str):
    v = d.get(name)
    if v is None or isinstance(v, bool) or not isinstance(v, kind):
        raise TraceError(f"{where}: field {name!r} missing or not {getattr(kind, '__name__', 'a number')}")
    return v


def _chain(ids: list[int]) -> tuple[int, ...]:
    """Our chained hashes of a trace's block ids (an id says what its block holds)."""
    out, h = [], None
    for i in ids:
        h = hash_block(h, (i & _U32, i >> 32), "trace")
        out.append(h)
    return tuple(out)


def write_mooncake(workload: Workload, path: str | Path) -> None:
    """An open-loop workload as a trace: block ids numbered in order of first use (equal hash,
    equal id), one per workload.block_size tokens, a trailing partial block under an id of
    its own; timestamps in milliseconds (to the microsecond)."""
    if workload.closed_loop:
        raise ValueError("a closed-loop workload has no arrival times to write")
    ids: dict[int, int] = {}
    with Path(path).open("w") as f:
        for r in workload.requests:
            hash_ids = [ids.setdefault(h, len(ids)) for h in r.block_hashes]
            if r.input_tokens % workload.block_size:
                hash_ids.append(ids.setdefault(-1 - r.rid, len(ids)))  # no block hash is negative
            ms = round(r.arrival_s * 1000.0, 3)
            f.write(
                json.dumps(
                    {
                        "timestamp": int(ms) if ms == int(ms) else ms,
                        "input_length": r.input_tokens,
                        "output_length": r.output_tokens,
                        "hash_ids": hash_ids,
                    }
                )
                + "\n"
            )
