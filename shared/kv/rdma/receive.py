"""The receiving end of the RDMA path, as a library: the transfer engine with the whole KV pool
registered once, and the check of each written block against the sender's checksum before it
is cached. Main decode's service (services/main_decode/rdma_receiver.py) offers the slots and
answers over NATS."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import torch

from shared.config import RdmaSettings
from shared.engine import Engine
from shared.kv.rdma.engine import RdmaEngine, RdmaError
from shared.kv.rdma.layout import block_checksum
from shared.telemetry import metrics

log = logging.getLogger(__name__)


def start_engine(rdma: RdmaSettings, address: str, pool: torch.Tensor) -> RdmaEngine | None:
    """The engine with `pool` registered whole (blocking); None, logged, when it cannot start.
    address: the receiver's bulk address, whose host the engine takes when rdma.host is unset."""
    try:
        engine = RdmaEngine(rdma.host or urlsplit(address).hostname or "", rdma.protocol, rdma.device)
        engine.register(pool)  # the whole pool, once
    except (RdmaError, ValueError, OSError) as e:
        log.warning("RDMA path off, KV comes over the TCP channel: %s", e)
        return None
    log.info(
        "RDMA path on: %s engine %s, %d B of KV pool registered",
        rdma.protocol,
        engine.session,
        pool.numel() * pool.element_size(),
    )
    return engine


def adopt_verified(
    engine: Engine, rid: str, checks: list[tuple[int, int, int]], algo: str
) -> tuple[list[int], list[int]]:
    """Engine thread: cache each block (hash, slot, expected checksum) whose slot holds what the
    sender wrote; hand back the others' slots to the request. Returns (good, corrupt) hashes."""
    kv = engine.slot_memory()
    good, corrupt = [], []
    for h, slot, expected in checks:
        if block_checksum(kv, slot, algo) == expected:
            engine.adopt(rid, h, slot)
            good.append(h)
        else:
            engine.return_spare(rid, slot)  # the TCP resend lands in it
            corrupt.append(h)
    if corrupt:
        metrics.KV_RDMA_CORRUPT_BLOCKS.inc(len(corrupt))
        log.warning(
            "request %s: %d blocks written over RDMA failed their checksum (not cached)", rid, len(corrupt)
        )
    return good, corrupt
