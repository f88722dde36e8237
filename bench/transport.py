"""Transport benchmark: bulk channel vs raw socket, WAN emulator accuracy, NATS latency.

    python -m bench.transport [--quick] [--size-mib 32] [--pairs 40] [--rows tcp_1,tcp_32]
                              [--out bench/out/transport.json]

Receivers run in a child process (as in deployment), senders here. Rows: raw socket (against
itself: the noise floor), the bulk channel in plaintext over TCP (1 and 32 frames, checksums
on and off, and one request split over N parallel connections), the same over TLS 1.3 (mutual
certificates; each TLS row is also held against its plaintext twin, round by round: "TLS vs
plaintext") and over a Unix socket, and the rdma backend where bench/transport_rdma.py says
it is available. Each row runs in many short rounds, each paired with a raw-socket round (the
order alternates within pairs, and pairs go round-robin over the rows), so a slow spell of the
shared host hits both sides of a pair: the figure is the median of the per-pair ratios
(row GB/s over raw GB/s) with its interquartile range. CPU seconds per GB are the sender's (this
process) and the receiver's (the child); they move less with the host's load than GB/s.
"raw rounds kept N cores busy" tells the host's state: ~1 when the two ends shared one core
(neighbours held the other; then a row's "x raw" follows its CPU ratio), more when each end had
a core of its own (then it follows the slower end). Runs agree when that figure does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.client import start_wan
from pdd.benchkit.nats_lab import NatsSecurity
from pdd.benchkit.progress import Advance, add_quiet_option, progress
from pdd.benchkit.report import save_report
from shared.bus import NatsServer, flushed
from shared.kv import KVClientPool, KVTransfer, start_kv_server
from shared.kv.frame import byte_view
from shared.kv.transport import SNDBUF
from shared.ports import free_port
from shared.security import Pki, client_context, server_context

MiB = 1 << 20
SECRET = "bench-secret"
RAW_TIMEOUT_S = 30


# ---------------------------------------------------------------- receivers (child process)


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


def _receiver_main(conn: Any, nbytes: int, unix_path: str, pki_dir: str) -> None:
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


# ---------------------------------------------------------------- bulk vs raw


def _cpu_seconds(pid: int) -> float:
    """CPU time of a process (all its threads) so far, in ns resolution (/proc/*/stat counts ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


class _Cpu:
    """CPU seconds spent by the sender (this process) and the receiver (the child) over a block."""

    def __init__(self, receiver_pid: int) -> None:
        self.pid = receiver_pid

    def __enter__(self) -> _Cpu:
        self.t0 = (_cpu_seconds(os.getpid()), _cpu_seconds(self.pid))
        return self

    def __exit__(self, *exc: object) -> None:
        self.send = _cpu_seconds(os.getpid()) - self.t0[0]
        self.recv = _cpu_seconds(self.pid) - self.t0[1]


class _RawRow:
    """A blocking socket's sendall, then a one-byte ack: what the bulk channel is held against."""

    def __init__(self, port: int, data: memoryview) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)  # the bulk channel's options
        # A dead receiver fails the round in the kernel (a Python timeout would add a poll per send).
        for opt in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", RAW_TIMEOUT_S, 0))
        self.data = data

    def _round(self) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(self.data)
        self.sock.recv(1)
        return time.perf_counter() - t0

    async def round(self) -> float:
        # On the loop's thread, the one the bulk rows send from, so both halves of a pair send
        # from one thread (and raw pays no thread hand-off). Nothing else runs meanwhile.
        return self._round()

    async def close(self) -> None:
        self.sock.close()


class _BulkRow:
    """One request of `blocks` (send_blocks each, then finish), the time until it is acked.
    With `parallel` > 1 it goes through a KVTransfer whose groups are split over that many
    connections."""

    def __init__(
        self, address: str, blocks: list[torch.Tensor], csum: str | None, tls: Any, parallel: int
    ) -> None:
        self.address, self.blocks, self.csum, self.tls, self.parallel = address, blocks, csum, tls, parallel
        self.n = 0

    async def open(self) -> _BulkRow:
        # Long-lived connections, as in deployment (connect + handshake are not timed).
        self.pool = KVClientPool(
            SECRET, ssl=self.tls, checksum=self.csum, parallel=self.parallel, parallel_min_bytes=0
        )
        first = KVTransfer(self.pool, self.address, "warm-up")
        await first.send_blocks([0], self.blocks[0][:, :, :1])
        await first.finish()
        first.close()
        return self

    async def round(self) -> float:
        self.n += 1
        transfer = KVTransfer(self.pool, self.address, f"bench-{self.n}")
        t0 = time.perf_counter()
        try:
            for i, kv in enumerate(self.blocks):
                await transfer.send_blocks([i * 1000 + j for j in range(kv.shape[2])], kv)
            await transfer.finish()
        finally:
            transfer.close()
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self.pool.close()


def _kv_tensor(nbytes: int, nblocks: int) -> torch.Tensor:
    # [L=32, 2, n, block_size=16, kv_heads=8, head_dim] fp16: one block = 32*2*16*8*d*2 bytes.
    per_block = nbytes // nblocks
    head_dim = per_block // (32 * 2 * 16 * 8 * 2)
    return torch.randn(32, 2, nblocks, 16, 8, head_dim).to(torch.float16)


def _bulk_variants(addrs: dict, one: torch.Tensor, parallel: int, tls: Any) -> dict[str, _BulkRow]:
    per_block = [one[:, :, i : i + 1].contiguous() for i in range(32)]  # as a producer would emit them
    return {
        "bulk_tcp_1_frame": _BulkRow(addrs["tcp"], [one], "xxh3", None, 1),
        "bulk_tcp_32_frames": _BulkRow(addrs["tcp"], per_block, "xxh3", None, 1),
        f"bulk_tcp_1_frame_x{parallel}_conns": _BulkRow(addrs["tcp"], [one], "xxh3", None, parallel),
        f"bulk_tcp_32_frames_x{parallel}_conns": _BulkRow(addrs["tcp"], per_block, "xxh3", None, parallel),
        "bulk_tcp_32_frames_nocsum": _BulkRow(addrs["tcp"], per_block, "none", None, 1),
        # TLS rows, the channel's default (no checksum: the records' tags prove the bytes); each
        # is also held against its bulk_tcp_ twin, round by round (_tls_vs_plain)
        "bulk_tls_1_frame": _BulkRow(addrs["tls"], [one], None, tls, 1),
        "bulk_tls_32_frames": _BulkRow(addrs["tls"], per_block, None, tls, 1),
        f"bulk_tls_1_frame_x{parallel}_conns": _BulkRow(addrs["tls"], [one], None, tls, parallel),
        f"bulk_tls_32_frames_x{parallel}_conns": _BulkRow(addrs["tls"], per_block, None, tls, parallel),
        "bulk_tls_32_frames_xxh3": _BulkRow(addrs["tls"], per_block, "xxh3", tls, 1),
        "bulk_unix_32_frames": _BulkRow(addrs["unix"], per_block, "xxh3", None, 1),
    }


async def _rdma_row(nbytes: int) -> tuple[Any, str | None]:
    """The rdma backend's row (bench/transport_rdma.py), or why there is none."""
    try:
        from bench import transport_rdma
    except Exception as e:  # not there, or its engine's libraries missing
        return None, f"bench.transport_rdma not importable: {e}"
    why = transport_rdma.available()
    if why is not None:
        return None, why
    return await transport_rdma.open_rdma_row(nbytes, 32), None


def _bench_pki() -> tuple[str, Any]:
    pki_dir = tempfile.mkdtemp(prefix="pdd-bench-pki-")
    pki = Pki(Path(pki_dir))
    pki.ensure(["receiver", "sender"], ["127.0.0.1"])
    return pki_dir, client_context(pki.identity("sender"))


async def _timed(row: Any, pid: int) -> dict:
    """A round's seconds and the CPU seconds each end spent on it."""
    with _Cpu(pid) as cpu:
        t = await row.round()
    return {"t": t, "send_cpu": cpu.send, "recv_cpu": cpu.recv, "cpu": cpu.send + cpu.recv}


async def _pair(raw: _RawRow, row: Any, raw_first: bool, pid: int) -> dict:
    """One raw round and one round of `row`, in the order given; ratios are raw over row
    (of seconds: the GB/s ratio, and of CPU seconds both ends spent)."""
    if raw_first:
        r = await _timed(raw, pid)
        x = await _timed(row, pid)
    else:
        x = await _timed(row, pid)
        r = await _timed(raw, pid)
    return {
        **x,
        "raw_t": r["t"],
        "ratio": r["t"] / x["t"],
        "cpu_ratio": r["cpu"] / x["cpu"],
        "raw_cores": r["cpu"] / r["t"],
    }


async def _paired_rounds(raw: _RawRow, rows: dict[str, Any], pairs: int, warmup: int, pid: int) -> dict:
    """Pair index by pair index over all rows, so slow spells of the host are spread over every
    row; within a row the order alternates (raw first, then row first)."""
    out: dict[str, list[dict]] = {name: [] for name in rows}
    with progress("bulk pairs", total=warmup + pairs) as advance:
        for i in range(warmup + pairs):
            for name, row in rows.items():
                pair = await _pair(raw, row, raw_first=i % 2 == 0, pid=pid)
                if i >= warmup:
                    out[name].append(pair)
            advance()
    return out


async def bench_bulk(
    size: int, pairs: int, parallel: int = 4, warmup: int = 2, keep: str | None = None
) -> dict:
    """`keep`: only the rows whose name contains one of these comma-separated words (raw_tcp,
    the noise floor, always runs)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    unix_path = os.path.join(tempfile.mkdtemp(prefix="pdd-bench-"), "kv.sock")
    pki_dir, tls = _bench_pki()
    proc = ctx.Process(target=_receiver_main, args=(child, size, unix_path, pki_dir), daemon=True)
    proc.start()
    rows: dict[str, Any] = {}
    try:
        addrs = await asyncio.wait_for(asyncio.to_thread(parent.recv), 60)
        one = _kv_tensor(size, 32)  # 32 blocks
        assert one.numel() * 2 == size, "size must be a multiple of 1 MiB"
        raw = _RawRow(addrs["raw"], byte_view(one))
        rows["raw_tcp"] = _RawRow(addrs["raw"], byte_view(one))  # raw against raw: the noise floor
        for name, variant in _bulk_variants(addrs, one, parallel, tls).items():
            if _kept(name, keep):
                rows[name] = await variant.open()
        rdma, why = await _rdma_row(size) if _kept("rdma_32_frames", keep) else (None, None)
        if rdma is not None:
            rows["rdma_32_frames"] = rdma
        try:
            measured = await _paired_rounds(raw, rows, pairs, warmup, proc.pid)
        finally:
            await raw.close()
            for row in rows.values():
                await row.close()
        parent.send("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    result = {
        "bytes": size,
        "pairs": pairs,
        "parallel": parallel,
        "rows": {n: _summary(p, size) for n, p in measured.items()},
    }
    if why is not None:
        result["rows"]["rdma_32_frames"] = {"skipped": why}
    result["tls_vs_plain"] = _tls_vs_plain(measured, size)
    return result


def _tls_vs_plain(measured: dict[str, list[dict]], nbytes: int) -> dict:
    """Each TLS row against its plaintext twin: the n-th rounds of both ran in the same pass over
    the rows (seconds apart), so their ratio of seconds (plain over TLS, the GB/s ratio) sees the
    same host; median and interquartile range of those ratios."""
    out = {}
    for name, tls in measured.items():
        plain = measured.get(name.replace("bulk_tls_", "bulk_tcp_"))
        if not name.startswith("bulk_tls_") or not plain:
            continue
        q1, ratio, q3 = _quartiles([p["t"] / t["t"] for p, t in zip(plain, tls, strict=True)])
        c1, cpu, c3 = _quartiles([p["cpu"] / t["cpu"] for p, t in zip(plain, tls, strict=True)])
        out[name.removeprefix("bulk_tls_")] = {
            "ratio": ratio,
            "ratio_q1": q1,
            "ratio_q3": q3,
            "cpu_ratio": cpu,
            "cpu_ratio_q1": c1,
            "cpu_ratio_q3": c3,
            "plain_GBps": nbytes / statistics.median(p["t"] for p in plain) / 1e9,
            "tls_GBps": nbytes / statistics.median(t["t"] for t in tls) / 1e9,
        }
    return out


def _kept(name: str, keep: str | None) -> bool:
    return keep is None or any(word in name for word in keep.split(","))


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = np.percentile(xs, [25, 50, 75])
    return float(q1), float(med), float(q3)


def _summary(pairs: list[dict], nbytes: int) -> dict:
    """Median of the per-pair ratios (row GB/s over raw GB/s) and its interquartile range, the
    same for CPU (raw's CPU seconds over the row's: what the ratio tends to on a host whose cores
    are all busy); GB/s and CPU seconds per GB (sender: this process, receiver: the child) as medians."""
    q1, ratio, q3 = _quartiles([p["ratio"] for p in pairs])
    c1, cpu_ratio, c3 = _quartiles([p["cpu_ratio"] for p in pairs])
    t = statistics.median(p["t"] for p in pairs)
    return {
        "ratio_vs_raw": ratio,
        "ratio_q1": q1,
        "ratio_q3": q3,
        "cpu_ratio_vs_raw": cpu_ratio,  # raw's CPU seconds (both ends) over the row's, per pair
        "cpu_ratio_q1": c1,
        "cpu_ratio_q3": c3,
        "GBps": nbytes / t / 1e9,
        "raw_GBps": nbytes / statistics.median(p["raw_t"] for p in pairs) / 1e9,
        "send_cpu_s_per_GB": statistics.median(p["send_cpu"] for p in pairs) / (nbytes / 1e9),
        "recv_cpu_s_per_GB": statistics.median(p["recv_cpu"] for p in pairs) / (nbytes / 1e9),
        "raw_cores": statistics.median(p["raw_cores"] for p in pairs),
        "pairs": len(pairs),
    }


# ---------------------------------------------------------------- WAN emulator accuracy


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


# ---------------------------------------------------------------- NATS request/reply


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


# ---------------------------------------------------------------- main


def _print(results: dict) -> None:
    bulk = results.get("bulk")
    if bulk:
        print(
            f"\nbulk channel vs raw socket, {bulk['bytes'] // MiB} MiB per round, loopback,"
            f" {bulk['pairs']} pairs per row (x raw, CPU x raw: medians of per-pair ratios [IQR])"
        )
        cores = statistics.median(row["raw_cores"] for row in bulk["rows"].values() if "raw_cores" in row)
        print(
            f"  raw rounds kept {cores:.2f} cores busy: ~1 when both ends shared one core (x raw then"
            " follows CPU x raw), more when each end had its own; compare runs whose figure agrees"
        )
        for name, row in bulk["rows"].items():
            if "skipped" in row:
                print(f"  {name:30s} skipped: {row['skipped']}")
                continue
            print(
                f"  {name:30s} {row['GBps']:6.2f} GB/s (raw {row['raw_GBps']:5.2f})"
                f"   x{row['ratio_vs_raw']:.2f} [{row['ratio_q1']:.2f}-{row['ratio_q3']:.2f}]"
                f"   CPU x{row['cpu_ratio_vs_raw']:.2f} [{row['cpu_ratio_q1']:.2f}-{row['cpu_ratio_q3']:.2f}]"
                f"   CPU s/GB send {row['send_cpu_s_per_GB']:.2f} recv {row['recv_cpu_s_per_GB']:.2f}"
            )
        if bulk.get("tls_vs_plain"):
            print(
                "TLS vs plaintext, round by round (TLS GB/s over plain GB/s, CPU: plain's CPU s over TLS's)"
            )
        for name, r in bulk.get("tls_vs_plain", {}).items():
            print(
                f"  {name:30s} plain {r['plain_GBps']:5.2f} GB/s  TLS {r['tls_GBps']:5.2f} GB/s"
                f"   x{r['ratio']:.2f} [{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}]"
                f"   CPU x{r['cpu_ratio']:.2f} [{r['cpu_ratio_q1']:.2f}-{r['cpu_ratio_q3']:.2f}]"
            )
    wan = results.get("wan")
    if wan:
        print("\nWAN emulator bandwidth (one direction)")
        for r in wan["bandwidth"]:
            print(
                f"  set {r['set_mbps']:6.0f} Mbit/s   measured {r['measured_mbps']:8.1f}   error {r['error_pct']:+5.1f}%"
            )
        print(f"WAN emulator round trip (direct loopback RTT {wan['direct_rtt_ms']:.3f} ms subtracted)")
        for r in wan["rtt"]:
            print(
                f"  delay {r['delay_ms']:4.0f} ms jitter {r['jitter_ms']:3.0f} ms: set RTT {r['set_rtt_ms']:5.1f}  "
                f"added p50 {r['added_rtt_ms_p50']:6.2f} ms  error {r['error_ms']:+5.2f} ms  max {r['rtt_ms_max']:.1f} ms"
            )
    nats = results.get("nats")
    if nats:
        print("\nNATS request/reply latency")
        for name, r in nats.items():
            print(f"  {name:16s} p50 {r['p50_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms   (n={r['count']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdd bench transport", description=__doc__)
    p.add_argument("--size-mib", type=int, default=32, help="bytes per round (a multiple of 1 MiB)")
    p.add_argument("--pairs", type=int, default=40, help="paired rounds per row (after 2 warm-up pairs)")
    p.add_argument("--parallel", type=int, default=4, help="connections of the parallel row")
    p.add_argument("--rows", help="bulk rows whose name contains one of these comma-separated words")
    p.add_argument("--quick", action="store_true", help="shorter WAN and NATS runs")
    p.add_argument("--only", choices=["bulk", "wan", "nats"], action="append")
    p.add_argument("--out", default="bench/out/transport.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    only = set(args.only or ["bulk", "wan", "nats"])

    async def run() -> dict:
        results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        if "bulk" in only:
            results["bulk"] = await bench_bulk(args.size_mib * MiB, args.pairs, args.parallel, keep=args.rows)
        if "wan" in only:
            results["wan"] = await bench_wan(args.quick)
        if "nats" in only:
            results["nats"] = await bench_nats(args.quick)
        return results

    save_report(asyncio.run(run()), args.out, table=_print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
