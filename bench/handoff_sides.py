"""`pdd bench handoff`'s far sides, each a process of its own: main decode's side (it takes the
handoff batches off NATS, extends and decodes) and the cross-DC KV receiver."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import torch

from pdd.benchkit.nats_lab import NatsSecurity
from shared.bus import decode, flushed
from shared.bus.messages import HandoffBatch
from shared.security import Identity, client_context, server_context
from shared.security.credentials import Credentials


def _prompt(n: int) -> list[int]:
    rng = random.Random(1234)
    return [rng.randrange(3, 250) for _ in range(n)]


# ---------------------------------------------------------------- MD side (child process)
class _MDSide:
    """MD's engine with the prompt's KV pinned in its pool; receives KV and handoff batches."""

    def __init__(self, conn: Any, cfg: dict):
        from shared.config import EngineSettings, ModelSettings
        from shared.engine import LLMEngine, Mode, SamplingParams

        self.conn = conn
        self.cfg = cfg
        self.engine = LLMEngine(
            ModelSettings(preset=cfg["preset"]),
            EngineSettings(
                kv_memory_mb=cfg["kv_memory_mb"], max_model_len=cfg["context"] + 4 * cfg["tokens"] + 64
            ),
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=cfg["tokens"] + 16, ignore_eos=True)
        self.prompt = _prompt(cfg["context"])
        # Reference: straight greedy decoding of tokens + 1 tokens. The first `tokens` are
        # what RLD hands over; the last is what MD must sample after its extend pass.
        e = self.engine
        e.add_request(
            "ref", self.prompt, SamplingParams(temperature=0.0, max_tokens=cfg["tokens"] + 1, ignore_eos=True)
        )
        ref: list[int] = []
        while e.has_unfinished():
            ref += [o.token_id for o in e.step() if o.token_id is not None]
        self.reference = ref
        e.exchange.reset_prefix_cache()  # forget the generated tokens' blocks: the extend must compute them
        # The prompt's KV, as MD holds it once the prompt has crossed the WAN: pinned.
        e.add_request("ctx", self.prompt, self.params, mode=Mode.HOLD)
        while e.has_unfinished():
            e.step()
        e.exchange.pin_blocks("ctx", e.block_hashes(self.prompt))
        e.abort("ctx")
        self.kv_t0: float | None = None

    # KV sink --------------------------------------------------------------------------
    async def on_blocks(self, rid: str, hashes: list[int], kv: torch.Tensor, traceparent: str | None) -> None:
        if rid.startswith("x-"):
            return  # another request's KV (cross traffic): not ours to keep
        t_arrive = time.monotonic()
        t = time.perf_counter()
        self.engine.exchange.import_blocks(hashes, kv)  # the device copy into MD's pool
        copy_s = time.perf_counter() - t
        self.conn.send(("kv", rid, t_arrive, time.monotonic(), copy_s, kv.numel() * kv.element_size()))

    async def on_done(self, rid: str, payload: bytes) -> None:
        pass

    async def on_abort(self, rid: str, reason: str) -> None:
        pass

    # token IDs ------------------------------------------------------------------------
    def prepare(self, rid: str) -> None:
        """MD holds the request with its prompt KV computed, waiting for the handoff."""
        from shared.engine import Mode

        e = self.engine
        e.exchange.reset_prefix_cache()  # drop blocks of earlier repetitions (KV imports, extends)
        e.add_request(rid, self.prompt, self.params, mode=Mode.HOLD)
        while e.has_unfinished():
            e.step()

    async def on_handoff(self, raw: Any) -> None:
        t_recv = time.monotonic()
        batch = decode(HandoffBatch, raw.data)
        e = self.engine
        c0 = time.thread_time()  # torch runs single-threaded here: the forward's own CPU time
        e.extend(batch.rid, batch.tokens, final=batch.final)
        token = None
        while token is None:
            for o in e.step():
                if o.rid == batch.rid and o.token_id is not None:
                    token = o.token_id
        t_done = time.monotonic()
        cpu = time.thread_time() - c0
        e.abort(batch.rid)
        self.conn.send(("tok", batch.rid, t_recv, t_done, token, len(raw.data), cpu))


SECRET = "bench-handoff"
SUBJECT = "bench.handoff"
KiB = 1024
MiB = 1 << 20


def md_side_main(conn: Any, cfg: dict) -> None:
    torch.set_num_threads(cfg["threads"])

    async def serve() -> None:
        from shared.kv import start_kv_server

        md = _MDSide(conn, cfg)
        sec = NatsSecurity(Credentials(Path(cfg["secrets"])))
        tls = server_context(sec.creds.identity("main_decode"))
        server = await start_kv_server(f"tcp://127.0.0.1:{cfg['kv_port']}", SECRET, md, ssl=tls)
        nc = await sec.connect(cfg["nats_b"], "bench-md")
        await nc.subscribe(SUBJECT, cb=md.on_handoff)
        await flushed(nc)
        conn.send(("up", md.reference))
        loop = asyncio.get_running_loop()
        while True:
            cmd, arg = await loop.run_in_executor(None, conn.recv)
            if cmd == "prepare":
                md.prepare(arg)
                conn.send(("ready", arg))
            elif cmd == "stop":
                break
        await nc.drain()
        await server.close()

    asyncio.run(serve())


# ---------------------------------------------------------------- cross traffic (child process)
def cross_traffic_main(
    address: str,
    rate_bps: float,
    load: float,
    mean_bytes: int,
    block_bytes: int,
    seed: int,
    stop: Any,
    ready: Any,
    identity: Identity,
) -> None:
    """Other requests' KV on the same link: Poisson arrivals, exponential sizes, `load` of the link."""
    torch.set_num_threads(1)

    async def run() -> None:
        from shared.kv import open_kv_client

        rng = random.Random(seed)
        max_blocks = max(1, 8 * mean_bytes // block_bytes)
        big = torch.randn(max_blocks, block_bytes // 4)  # float32 rows, one per block
        client = await open_kv_client(address, SECRET, checksum="xxh3", ssl=client_context(identity))
        gap = mean_bytes / (load * rate_bps)
        t_next = time.monotonic()
        i = 0
        while not stop.is_set():
            t_next += rng.expovariate(1 / gap)
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            n = min(max_blocks, max(1, round(rng.expovariate(block_bytes / mean_bytes))))
            kv = big[:n].reshape(1, 1, n, 1, 1, block_bytes // 4)
            rid = f"x-{i}"
            i += 1
            await client.send_blocks(rid, [rng.getrandbits(60) for _ in range(n)], kv)
            await client.finish(rid)
            ready.set()  # cross traffic is flowing
        await client.close()

    asyncio.run(run())
