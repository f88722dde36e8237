"""The RDMA path's engine: the Mooncake Transfer Engine (the `rdma` extra), one per process.

It runs protocol "rdma" on RoCE / InfiniBand NICs and "tcp" over sockets (same API, for
machines without such a NIC). Peers find each other point to point (P2PHANDSHAKE): a peer's
engine is named by its session, "host:rpc_port". Memory is registered once and written into
one-sidedly by whoever knows its address and the session.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PROTOCOLS = ("rdma", "tcp")


class RdmaError(Exception):
    """The RDMA path cannot be used (engine missing, refused to start) or a write failed."""


def unavailable() -> str | None:
    """Why the engine cannot be loaded here (None: it can)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:  # the extra is not installed, or libibverbs / libnuma are missing
        return f"mooncake transfer engine not loadable ({e}); install the `rdma` extra and libibverbs1"
    return None


class RdmaEngine:
    def __init__(self, host: str, protocol: str, device: str = ""):
        if protocol not in PROTOCOLS:
            raise RdmaError(f"rdma protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        why = unavailable()
        if why is not None:
            raise RdmaError(why)
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RdmaError(f"transfer engine failed to start on {host} ({protocol} {device!r}): rc={rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol
        self._registered: list[torch.Tensor] = []  # kept alive while registered

    def register(self, tensor: torch.Tensor) -> None:
        """Make a contiguous host tensor's memory reachable by peers (once, at start)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise RdmaError(
                f"only contiguous host memory is registered here (got {tensor.device}, contiguous={tensor.is_contiguous()})"
            )
        nbytes = tensor.numel() * tensor.element_size()
        rc = self._engine.register_memory(tensor.data_ptr(), nbytes)
        if rc != 0:
            raise RdmaError(f"registering {nbytes} bytes failed: rc={rc}")
        self._registered.append(tensor)

    def write(self, session: str, runs: list[tuple[int, int, int]]) -> None:
        """One-sided writes of (local address, peer address, length) runs; blocks until all
        landed. Raises RdmaError when any failed (the peer refused an address, is gone...)."""
        if not runs:
            return
        src, dst, lengths = (list(x) for x in zip(*runs, strict=True))
        rc = self._engine.batch_transfer_sync_write(session, src, dst, lengths)
        if rc != 0:
            raise RdmaError(f"write of {sum(lengths)} bytes to {session} failed: rc={rc}")

    def close(self) -> None:
        for tensor in self._registered:
            self._engine.unregister_memory(tensor.data_ptr())
        self._registered.clear()
