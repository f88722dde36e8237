"""Handoff microbenchmark (token IDs + an extend pass instead of KV): hand 100 generated tokens from RLD to MD.

Two ways, measured side by side, repetition by repetition (alternating which goes first):
  (a) KV: ship the incremental KV of those tokens over the emulated WAN on the real bulk
      channel (`open_kv_client` -> WAN link -> `start_kv_server`), then copy it into MD's
      KV pool (`LLMEngine.exchange.import_blocks`). Latency: send start -> blocks in MD's pool.
  (b) token IDs: publish a `HandoffBatch` with the 100 IDs on nats-a; it crosses the NATS
      gateway (through WAN links) to MD on nats-b, which runs one extend pass over them
      (`add_request(mode=Mode.HOLD)` beforehand, `extend(rid, ids, final=True)` then steps)
      and samples the next token. Latency: publish -> next token sampled on MD.
MD (engine, KV receiver, NATS subscriber) runs in a child process, as in deployment; the
WAN emulator and the NATS servers are their own processes. One-way latencies use the
machine-wide monotonic clock. The extend pass is also timed in CPU time (torch runs on one
thread here), which separates its own cost from waits for a core on a shared host.

Two conditions, each with --reps repetitions:
  jitter    the WAN link alone: one-way delay, uniform jitter, bandwidth cap.
  queueing  the same, plus other requests' KV competing on the bulk link (Poisson
            arrivals, --cross-load of its bandwidth), as on a shared line.

    python -m bench.handoff [--quick] [--reps 100] [--tokens 100] [--context 1024]
        [--delay-ms 15] [--jitter-ms 5] [--bandwidth-mbps 100] [--cross-load 0.5]

Writes bench/out/handoff.json and bench/out/handoff.png.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.client import start_wan
from bench.handoff_report import figure, print_report, summarize_condition, targets_of
from bench.handoff_sides import SECRET, SUBJECT, KiB, cross_traffic_main, md_side_main
from pdd.benchkit.nats_lab import NatsSecurity
from pdd.benchkit.progress import add_quiet_option, progress
from pdd.benchkit.report import save_report
from shared.bus import encode
from shared.bus.messages import HandoffBatch, HandoffMode
from shared.bus.nats_server import free_port
from shared.security import client_context


def _kv_payload(args: argparse.Namespace, block_size: int) -> tuple[int, tuple, int]:
    """What the shipping variant sends, the output tokens' blocks (float32, as the pool): their
    number (the last one partly filled), the tensor's shape, the bytes per token."""
    from shared.model.presets import preset_config

    c = preset_config(args.preset, 0)
    nblocks = -(-args.tokens // block_size)
    return (
        nblocks,
        (c.num_layers, 2, nblocks, block_size, c.num_kv_heads, c.head_dim),
        c.kv_bytes_per_token(4),
    )


class Bench:
    """The parent: the relay's side in DC A, which sends the handoff batches and measures."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.reference: list[int] = []

    async def setup(self) -> None:
        kv_port, gateways = self._start_wan()
        await self._start_nats(*gateways)
        await self._start_md_side(kv_port)
        self.nc = await self.sec.connect(self.nats_a, "bench-rld")
        from shared.kv import open_kv_client

        self.kv = await open_kv_client(
            self.bulk_address, SECRET, ssl=client_context(self.sec.creds.identity("prefill"))
        )
        self.block_size = 16
        self.nblocks, self.kv_shape, self.kv_bytes_per_token = _kv_payload(self.args, self.block_size)
        self.kv_tensor = torch.randn(*self.kv_shape)  # float32, as the engine's pool
        # Interest in SUBJECT must have crossed the gateway before the first timed publish.
        await self._wait_interest()

    def _start_wan(self) -> tuple[int, tuple[int, int, int, int]]:
        """The WAN emulator between the DCs (bulk link, gateway both ways); MD's KV port and the
        gateway ports (A, B, A->B link, B->A link)."""
        a = self.args
        kv_port, bulk_port = free_port(), free_port()
        gw_a, gw_b, l_ab, l_ba = free_port(), free_port(), free_port(), free_port()
        links = [
            f"bulk=127.0.0.1:{bulk_port}>127.0.0.1:{kv_port}",
            f"gw-ab=127.0.0.1:{l_ab}>127.0.0.1:{gw_b}",
            f"gw-ba=127.0.0.1:{l_ba}>127.0.0.1:{gw_a}",
        ]
        self.wan_proc, self.wan = start_wan(
            links,
            "--delay-ms",
            str(a.delay_ms),
            "--jitter-ms",
            str(a.jitter_ms),
            "--bandwidth-mbps",
            str(a.bandwidth_mbps),
        )
        self.bulk_address = f"tcp://127.0.0.1:{bulk_port}"
        return kv_port, (gw_a, gw_b, l_ab, l_ba)

    async def _start_nats(self, gw_a: int, gw_b: int, l_ab: int, l_ba: int) -> None:
        """Two datacenters' NATS servers, their gateway connections through the WAN (as `pdd up`).
        Secured as `pdd up` runs them: mutual TLS (clients, gateway, KV channel), NATS users."""
        self.sec = NatsSecurity.create(Path(tempfile.mkdtemp(prefix="pdd-bench-handoff-")))
        self.nats_b = self.sec.server(
            "nats-b",
            "nats-b",
            gateway_port=gw_b,
            gateways={"nats-a": f"nats://127.0.0.1:{l_ba}"},
            gateway_advertise=f"127.0.0.1:{l_ab}",
        )
        self.nats_a = self.sec.server(
            "nats-a",
            "nats-a",
            gateway_port=gw_a,
            gateways={"nats-b": f"nats://127.0.0.1:{l_ab}"},
            gateway_advertise=f"127.0.0.1:{l_ba}",
        )
        await self.nats_b.start()
        await self.nats_a.start()
        await self.nats_a.wait_gateways(20)
        await self.nats_b.wait_gateways(20)

    async def _start_md_side(self, kv_port: int) -> None:
        """MD's side in a process of its own; its reference output once it is up."""
        a = self.args
        cfg = {
            "preset": a.preset,
            "context": a.context,
            "tokens": a.tokens,
            "kv_memory_mb": 256,
            "kv_port": kv_port,
            "nats_b": self.nats_b.url,
            "threads": a.threads,
            "secrets": str(self.sec.creds.dir),
        }
        self.conn, child = self.ctx.Pipe()
        self.md = self.ctx.Process(target=md_side_main, args=(child, cfg), daemon=True)
        self.md.start()
        self.procs.append(self.md)
        kind, self.reference = await self._recv(180)
        assert kind == "up"

    async def _recv(self, timeout: float = 60) -> tuple:
        return await asyncio.wait_for(asyncio.to_thread(self.conn.recv), timeout)

    async def _wait_interest(self) -> None:
        for _ in range(3):
            await self.token_once("warm-interest")

    async def teardown(self) -> None:
        for closer in (
            self._stop_md,
            self.kv.close,
            self.nc.drain,
            self._stop_wan,
            self.nats_a.stop,
            self.nats_b.stop,
        ):
            try:
                await closer()
            except Exception as e:  # keep tearing down
                print(f"teardown: {e}", file=sys.stderr)

    async def _stop_wan(self) -> None:
        # Before the NATS servers: their gateway links then reset instead of half-closing
        # through the emulator (whose send_eof trips over an already disconnected socket).
        self.wan_proc.terminate()
        await asyncio.to_thread(self.wan_proc.wait, 10)

    async def _stop_md(self) -> None:
        if self.md.is_alive():
            self.conn.send(("stop", None))
            await asyncio.to_thread(self.md.join, 10)
        if self.md.is_alive():
            self.md.kill()

    # one repetition of each path ---------------------------------------------------------
    async def kv_once(self, rid: str) -> dict:
        hashes = [random.getrandbits(62) for _ in range(self.nblocks)]
        sent0 = self.kv.bytes_sent
        t0 = time.monotonic()
        await self.kv.send_blocks(rid, hashes, self.kv_tensor)
        kind, _, t_arrive, t_landed, copy_s, nbytes = await self._recv()
        await self.kv.finish(rid)
        assert kind == "kv"
        return {
            "total": t_landed - t0,
            "wire": t_arrive - t0,
            "copy": copy_s,
            "payload": nbytes,
            "frame_bytes": self.kv.bytes_sent - sent0,
        }

    async def token_once(self, rid: str) -> dict:
        self.conn.send(("prepare", rid))
        kind, _ = await self._recv()
        assert kind == "ready"
        tokens = self.reference[: self.args.tokens]
        msg = HandoffBatch(rid, 0, 0, tokens, final=True, mode=HandoffMode.ONE_SHOT)
        payload = encode(msg)
        t0 = time.monotonic()
        await self.nc.publish(SUBJECT, payload)
        await self.nc.flush()
        kind, _, t_recv, t_done, token, nbytes, cpu = await self._recv(30)
        assert kind == "tok"
        return {
            "total": t_done - t0,
            "wire": t_recv - t0,
            "extend": t_done - t_recv,
            "extend_cpu": cpu,
            "total_cpu": t_recv - t0 + cpu,
            "payload": nbytes,
            "correct": token == self.reference[self.args.tokens],
        }

    async def wire_bytes(self) -> dict:
        """Bytes that cross the WAN for one handoff each way (the links' counters, idle link)."""

        async def moved(links: list[str], fn) -> int:
            before = await self.wan.get()
            await fn()
            await asyncio.sleep(0.3)  # let the last bytes leave the delay line
            after = await self.wan.get()
            return sum(
                after[n]["bytes_up"]
                + after[n]["bytes_down"]
                - before[n]["bytes_up"]
                - before[n]["bytes_down"]
                for n in links
            )

        kv = await moved(["bulk"], lambda: self.kv_once("wire-kv"))
        tok = await moved(["gw-ab", "gw-ba"], lambda: self.token_once("wire-tok"))
        return {"kv": kv, "token": tok}

    async def _start_cross(self, cross_load: float) -> tuple[Any, Any]:
        """Other requests' KV on the bulk link (a child process); returns it and its stop event."""
        a = self.args
        stop, ready = self.ctx.Event(), self.ctx.Event()
        if not a.bandwidth_mbps:
            raise SystemExit(
                "--cross-load is a share of the bandwidth cap: it needs --bandwidth-mbps above 0"
            )
        rate = a.bandwidth_mbps * 1e6 / 8
        block_bytes = self.kv_tensor[:, :, :1].numel() * 4
        cross = self.ctx.Process(
            target=cross_traffic_main,
            args=(
                self.bulk_address,
                rate,
                cross_load,
                a.cross_mean_kib * KiB,
                block_bytes,
                a.seed,
                stop,
                ready,
                self.sec.creds.identity("prefill"),
            ),
            daemon=True,
        )
        cross.start()
        self.procs.append(cross)
        if not await asyncio.to_thread(ready.wait, 60):  # spawn + torch import + a first transfer
            raise RuntimeError("cross traffic did not start within 60 s")
        return cross, stop

    async def condition(self, name: str, cross_load: float) -> dict:
        a = self.args
        cross, stop = await self._start_cross(cross_load) if cross_load > 0 else (None, None)
        kv, tok = [], []
        rng = random.Random(a.seed)
        try:
            with progress(name, total=a.warmup + a.reps) as advance:
                for i in range(a.warmup + a.reps):
                    order = [("kv", self.kv_once), ("tok", self.token_once)]
                    if i % 2:
                        order.reverse()
                    for path, fn in order:
                        r = await fn(f"{name}-{path}-{i}")
                        if i >= a.warmup:
                            (kv if path == "kv" else tok).append(r)
                        await asyncio.sleep(rng.uniform(0.02, 0.08))  # desynchronise from the cross traffic
                    advance()
        finally:
            if stop is not None and cross is not None:
                stop.set()
                await asyncio.to_thread(cross.join, 15)
                if cross.is_alive():
                    cross.kill()
        return summarize_condition(kv, tok, cross_load)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdd bench handoff",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="50 repetitions per condition")
    p.add_argument("--reps", type=int, default=100, help="timed repetitions per path and condition (>= 50)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=100, help="generated tokens handed over")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens MD already holds")
    p.add_argument("--preset", default="small")
    p.add_argument("--delay-ms", type=float, default=15.0, help="one-way WAN delay")
    p.add_argument("--jitter-ms", type=float, default=5.0, help="uniform jitter on the delay, +-ms")
    p.add_argument(
        "--bandwidth-mbps",
        type=float,
        default=100.0,
        help="WAN cap; 100 Mbit/s puts 1.75 MiB on the wire for ~150 ms, like the paper's 185 ms mean",
    )
    p.add_argument(
        "--cross-load", type=float, default=0.5, help="queueing condition: other KV, fraction of the link"
    )
    p.add_argument("--cross-mean-kib", type=int, default=2048, help="mean size of one competing KV transfer")
    p.add_argument("--conditions", default="jitter,queueing", help="comma list of jitter, queueing")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of MD (2 on this 2-core host collapses under any competing load)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out/handoff.json")
    add_quiet_option(p)
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 50
    return args


def _payload(b: Bench, wire: dict, first: dict) -> dict:
    """Bytes of one handoff each way: payloads and what crossed the WAN links."""
    tokens = b.args.tokens
    payload = {
        "kv_payload_bytes": first["kv_payload_bytes"],
        "kv_frame_bytes": first["kv_frame_bytes"],
        "kv_wan_bytes": wire["kv"],
        "kv_blocks": b.nblocks,
        "block_size": b.block_size,
        "kv_bytes_per_token": b.kv_bytes_per_token,
        "kv_useful_bytes": tokens * b.kv_bytes_per_token,
        "token_payload_bytes": first["token_payload_bytes"],
        "token_wan_bytes": wire["token"],
    }
    payload["kv_over_token"] = payload["kv_wan_bytes"] / max(payload["token_wan_bytes"], 1)
    return payload


async def run(args: argparse.Namespace) -> dict:
    b = Bench(args)
    with progress("starting NATS, WAN emulator, MD"):
        await b.setup()
    try:
        wire = await b.wire_bytes()
        conds: dict[str, Any] = {}
        for name in args.conditions.split(","):
            conds[name] = await b.condition(name, args.cross_load if name == "queueing" else 0.0)
            print(f"  {name}: done", flush=True)
    finally:
        await b.teardown()
    payload = _payload(b, wire, next(iter(conds.values())))
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
        "payload": payload,
        "conditions": conds,
        "targets": targets_of(payload, conds),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    random.seed(args.seed)
    save_report(asyncio.run(run(args)), args.out, table=print_report, figures=figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
