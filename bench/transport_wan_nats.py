"""`pdd bench transport`'s WAN emulator accuracy (delay and bandwidth as set vs as measured)
and NATS request/reply latency."""

from __future__ import annotations

import asyncio
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.client import start_wan
from bench.transport_receivers import MiB
from pdd.benchkit.nats_lab import NatsSecurity
from pdd.benchkit.progress import Advance, progress
from shared.bus import NatsServer, flushed
from shared.ports import free_port


def _measure_throughput(listen_port: int, target: socket.socket, nbytes: int) -> float:
    done: dict[str, float] = {}

    def rx() -> None:
        conn, _ = target.accept()
        with conn:
            buf = memoryview(bytearray(MiB))
            got = 0
            while got < nbytes:
                k = conn.recv_into(buf)
                if not k:
                    break
                got += k
            done["t"] = time.perf_counter()
            done["ok"] = got == nbytes

    th = threading.Thread(target=rx)
    th.start()
    data = bytearray(nbytes)
    with socket.create_connection(("127.0.0.1", listen_port)) as s:
        t0 = time.perf_counter()
        s.sendall(data)
        th.join(60)
    assert done.get("ok"), "short transfer through the WAN emulator"
    return nbytes / (done["t"] - t0)


def _echo_server(sock: socket.socket) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(65536):
                conn.sendall(data)


def _ping(port: int, count: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            out.append(time.perf_counter() - t0)
    return out


async def bench_wan(quick: bool) -> dict:
    sink = socket.create_server(("127.0.0.1", 0))
    echo = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_echo_server, args=(echo,), daemon=True).start()
    lt, le = free_port(), free_port()
    proc, ctl = start_wan(
        [
            f"tput=127.0.0.1:{lt}>127.0.0.1:{sink.getsockname()[1]}",
            f"echo=127.0.0.1:{le}>127.0.0.1:{echo.getsockname()[1]}",
        ]
    )
    seconds = 0.6 if quick else 1.5
    try:
        with progress("WAN emulator", total=6) as advance:
            return await _wan_rounds(ctl, lt, le, sink, echo, seconds, quick, advance)
    finally:
        proc.terminate()
        proc.wait(10)
        sink.close()
        echo.close()


async def _wan_rounds(
    ctl: Any,
    lt: int,
    le: int,
    sink: socket.socket,
    echo: socket.socket,
    seconds: float,
    quick: bool,
    advance: Advance,
) -> dict:
    """Three bandwidth caps, then three delays (with and without jitter)."""
    rows = []
    for mbps in (10, 100, 1000):
        await ctl.set("tput", bandwidth_mbps=mbps, delay_ms=0, jitter_ms=0)
        bps = await asyncio.to_thread(_measure_throughput, lt, sink, int(mbps * 1e6 / 8 * seconds))
        rows.append(
            {
                "set_mbps": mbps,
                "measured_mbps": bps * 8 / 1e6,
                "error_pct": (bps * 8 / 1e6 / mbps - 1) * 100,
            }
        )
        advance()
    direct = statistics.median(await asyncio.to_thread(_ping, echo.getsockname()[1], 50))
    rtts = []
    for delay_ms, jitter_ms in ((5, 0), (15, 0), (15, 2)):
        await ctl.set("echo", delay_ms=delay_ms, jitter_ms=jitter_ms)
        samples = await asyncio.to_thread(_ping, le, 20 if quick else 40)
        med = statistics.median(samples)
        rtts.append(
            {
                "delay_ms": delay_ms,
                "jitter_ms": jitter_ms,
                "set_rtt_ms": 2 * delay_ms,
                "added_rtt_ms_p50": (med - direct) * 1000,
                "error_ms": (med - direct) * 1000 - 2 * delay_ms,
                "rtt_ms_max": max(samples) * 1000,
            }
        )
        advance()
    return {"bandwidth": rows, "rtt": rtts, "direct_rtt_ms": direct * 1000}


async def _nats_latency(sec: NatsSecurity, req: NatsServer, rep: NatsServer, count: int, name: str) -> dict:
    """Request/reply latency over mutual TLS, logged in as the lab user (any subject)."""
    nc_rep = await sec.connect(rep, "bench-rep")
    nc_req = await sec.connect(req, "bench-req")
    try:

        async def pong(msg: Any) -> None:
            await msg.respond(msg.data)

        await nc_rep.subscribe("bench.ping", cb=pong)
        await flushed(nc_rep)
        for _ in range(50):  # interest must cross the gateway first
            try:
                await nc_req.request("bench.ping", b"x", timeout=0.2)
                break
            except Exception:
                await asyncio.sleep(0.05)
        lat = []
        payload = b"x" * 256
        with progress(f"NATS {name}", total=count) as advance:
            for _ in range(count):
                t0 = time.perf_counter()
                await nc_req.request("bench.ping", payload, timeout=2)
                lat.append((time.perf_counter() - t0) * 1000)
                advance()
        p50, p99 = np.percentile(lat, [50, 99])  # same definition as the other benches
        return {"p50_ms": float(p50), "p99_ms": float(p99), "count": count}
    finally:
        await nc_req.drain()
        await nc_rep.drain()


async def bench_nats(quick: bool) -> dict:
    count = 300 if quick else 1000
    sec = NatsSecurity.create(Path(tempfile.mkdtemp(prefix="pdd-bench-nats-")))
    b = sec.server("bench-b", "nats-b", gateway_port=free_port())
    await b.start()
    a = sec.server("bench-a", gateways={"bench-b": b.gateway_url})
    try:
        await a.start()
        await a.wait_gateways(15)
        await b.wait_gateways(15, names=["bench-a"])
        return {
            "one_server": await _nats_latency(sec, a, a, count, "one server"),
            "across_gateway": await _nats_latency(sec, a, b, count, "across gateway"),
        }
    finally:
        await a.stop()
        await b.stop()
