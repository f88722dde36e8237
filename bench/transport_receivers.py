"""`pdd bench transport`'s receivers, in a child process as in deployment: the raw socket's
counting sink and the bulk channel's server, over TCP, TLS and a Unix socket."""

from __future__ import annotations

import asyncio
import mmap
import socket
import threading
from pathlib import Path
from typing import Any

import torch

from shared.kv import start_kv_server
from shared.security import Pki, server_context

MiB = 1 << 20
SECRET = "bench-secret"
RAW_TIMEOUT_S = 30


class _CountingSink:
    """Drops what it receives (as fast as a sink can be); counts bytes."""

    def __init__(self) -> None:
        self.nbytes = 0

    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        self.nbytes += kv.numel() * kv.element_size()

    async def on_done(self, rid: str, payload: bytes) -> None:
        pass

    async def on_abort(self, rid: str, reason: str) -> None:
        pass


def _raw_receiver(lsock: socket.socket, nbytes: int) -> None:
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=_raw_connection, args=(conn, nbytes), daemon=True).start()


def _raw_connection(conn: socket.socket, nbytes: int) -> None:
    # Preallocated once, reused, private anonymous memory with huge pages, like the bulk
    # receiver's buffers (a shared mapping would get 4 KiB shmem pages): the best case for raw.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    mv = memoryview(buf)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            got = 0
            while got < nbytes:
                k = conn.recv_into(mv[got:])
                if not k:
                    return
                got += k
            conn.sendall(b"k")


def receiver_main(conn: Any, nbytes: int, unix_path: str, pki_dir: str) -> None:
    torch.set_num_threads(1)
    lsock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_receiver, args=(lsock, nbytes), daemon=True).start()
    tls = server_context(Pki(Path(pki_dir)).identity("receiver"))

    async def serve() -> None:
        tcp = await start_kv_server("tcp://127.0.0.1:0", SECRET, _CountingSink())
        tls_tcp = await start_kv_server("tcp://127.0.0.1:0", SECRET, _CountingSink(), ssl=tls)
        unix = await start_kv_server(f"unix://{unix_path}", SECRET, _CountingSink())
        addrs = {
            "raw": lsock.getsockname()[1],
            "tcp": tcp.address,
            "tls": tls_tcp.address,
            "unix": unix.address,
        }
        conn.send(addrs)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until the parent says stop
        for server in (tcp, tls_tcp, unix):
            await server.close()

    asyncio.run(serve())
