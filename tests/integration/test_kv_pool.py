"""KV connection pool: concurrent requests get their own connections, up to a cap."""

from __future__ import annotations

from shared.kv import KVClientPool, start_kv_server

from .test_kv_channel import SECRET, MemorySink, blocks


async def test_busy_connections_are_not_shared_until_the_cap():
    sink = MemorySink()
    server = await start_kv_server("tcp://127.0.0.1:0", SECRET, sink)
    pool = KVClientPool(SECRET, per_peer=2)
    try:
        a = await pool.acquire(server.address)
        b = await pool.acquire(server.address)
        assert a is not b  # a second request in flight gets a second connection
        c = await pool.acquire(server.address)
        assert c in (a, b)  # at the cap: the least busy one is shared
        pool.release(a)
        pool.release(c)
        pool.release(b)
        d = await pool.acquire(server.address)
        assert d in (a, b)  # idle connections are reused, not reopened
        await d.send_blocks("r1", [1, 2], blocks(2))
        await d.finish("r1")
        assert sink.hashes("r1") == [1, 2]
    finally:
        await pool.close()
        await server.close()
