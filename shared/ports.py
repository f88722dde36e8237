"""Ports to hand to another process (a nats-server, `pdd up`) before it binds them.

They come from below the kernel's ephemeral range (32768+ on Linux): a port picked by binding to
0 lies inside that range, so any outgoing connection made meanwhile (a gateway dialling a peer that
is not up yet) can take it, and the server then fails with "address already in use".
"""

from __future__ import annotations

import random
import socket
import threading

LOW, HIGH = 20000, 32000
SINGLES = 28000  # single ports from [SINGLES, HIGH), blocks from below: scattered singles would
# leave no room for a long block, and blocks start at multiples of their size for the same reason

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A base port with n consecutive ports free now and never handed out by this process."""
    with _lock:
        for _ in range(500):
            base = random.randrange(SINGLES, HIGH) if n == 1 else random.randrange(LOW, SINGLES - n, n)
            block = range(base, base + n)
            if not _handed_out.isdisjoint(block) or not _bindable(host, block):
                continue
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no {n} free consecutive ports in {LOW}-{HIGH}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_port_block(1, host)


def _bindable(host: str, ports: range) -> bool:
    socks = []
    try:
        for port in ports:
            sock = socket.socket()
            socks.append(sock)
            sock.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()
