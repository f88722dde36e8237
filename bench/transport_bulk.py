"""`pdd bench transport`'s bulk rows: the bulk channel (plaintext, TLS, Unix socket, parallel
connections, rdma) against a raw socket, round by round in pairs, with CPU seconds per GB."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.transport_receivers import RAW_TIMEOUT_S, SECRET, receiver_main
from pdd.benchkit.progress import progress
from shared.kv import KVClientPool, TcpSender
from shared.kv.frame import byte_view
from shared.kv.transport import SNDBUF
from shared.security import Pki, client_context


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
    With `parallel` > 1 it goes through a TcpSender whose groups are split over that many
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
        first = TcpSender(self.pool, self.address, "warm-up")
        await first.send_blocks([0], self.blocks[0][:, :, :1])
        await first.finish()
        first.close()
        return self

    async def round(self) -> float:
        self.n += 1
        transfer = TcpSender(self.pool, self.address, f"bench-{self.n}")
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
    proc = ctx.Process(target=receiver_main, args=(child, size, unix_path, pki_dir), daemon=True)
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
